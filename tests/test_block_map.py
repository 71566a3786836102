"""The block map's shared-prefix flag (`BlockInfo.shared_prefix`): a block holds a preset system
prompt when it lies within some owner's unsalted leading blocks (engine/core/block_hash.py),
whether or not another request holds it too. Driven through the scheduler and the simulated
runner, as the engine builds its maps (`BlockMapState.take` on the engine thread, `build()`)."""
from engine.devtools.simulated_runner import run_step
from simulation import expected_block_map, make, request, run

PRESET = list(range(100, 110))  # 10 tokens over blocks of 4: blocks 0-1 are the preset's, block 2 straddles it
TAIL = [40, 41, 42, 43, 44, 45]


def chat(rid: str, salt: str | None, num_shared: int = len(PRESET), max_tokens: int = 8):
    return request(rid, PRESET + TAIL, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt,
                   num_shared_prefix_tokens=num_shared)


def steps(sched, runner, count: int) -> None:
    for _ in range(count):
        run_step(sched, runner)


def flagged(sched) -> set[int]:
    return {b.block_id for b in sched.block_map().device if b.shared_prefix}


def test_a_preset_chat_alone_has_only_its_preset_blocks_flagged():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(chat("ada/1", "ada"))
    steps(sched, runner, 2)
    ada = sched.requests["ada/1"]
    assert len(ada.block_ids) > 3
    assert flagged(sched) == set(ada.block_ids[:2])  # not the straddling block 2, nor its own after it
    device = sched.block_map().device
    assert all(device[b].ref_count == 1 for b in ada.block_ids[:2])  # flagged while no one else holds them
    assert sched.block_map() == expected_block_map(sched)
    run(sched, runner)
    assert flagged(sched) == set()  # cached blocks have no owner, so no owner's prefix


def test_two_users_on_one_preset_hold_the_same_flagged_blocks_and_their_own_unflagged():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(chat("ada/1", "ada", max_tokens=20))
    steps(sched, runner, 2)
    sched.add_request(chat("bob/1", "bob", max_tokens=20))
    steps(sched, runner, 1)
    ada, bob = sched.requests["ada/1"], sched.requests["bob/1"]
    # the preset's two blocks, hit by bob, and its last 2 tokens, copied from ada's third block
    assert bob.num_cached_tokens == 10 and ada.block_ids[:2] == bob.block_ids[:2]
    assert flagged(sched) == set(ada.block_ids[:2])
    device = sched.block_map().device
    assert all(device[b].ref_count == 2 for b in ada.block_ids[:2])
    assert not set(ada.block_ids[2:]) & set(bob.block_ids[2:])  # salted: each user's own
    assert sched.block_map() == expected_block_map(sched)


def test_no_salt_or_no_shared_prefix_flags_nothing():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(chat("anon/1", None))  # unsalted throughout: not a preset either
    sched.add_request(chat("ada/1", "ada", num_shared=0))  # salted from the first block
    steps(sched, runner, 2)
    assert sched.requests["anon/1"].block_ids and sched.requests["ada/1"].block_ids
    assert flagged(sched) == set()


def test_a_block_is_flagged_while_any_owner_holds_it_as_its_preset():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(chat("ada/1", "ada", max_tokens=4))
    steps(sched, runner, 1)
    sched.add_request(chat("anon/1", None, max_tokens=40))  # unsalted: hits the preset's blocks too
    steps(sched, runner, 1)
    preset = sched.requests["ada/1"].block_ids[:2]
    assert sched.requests["anon/1"].block_ids[:2] == preset and flagged(sched) == set(preset)
    while "ada/1" in sched.requests:
        steps(sched, runner, 1)
    assert "anon/1" in sched.requests and flagged(sched) == set()  # anon's own count is 0


def test_swapped_preset_blocks_stay_flagged_on_the_host():
    sched, runner = make(num_device_blocks=10, num_host_blocks=32, preemption_mode="swap")
    for user in ("ada", "bob", "cy"):
        sched.add_request(chat(f"{user}/1", user, max_tokens=16))
    maps = []
    run(sched, runner, on_step=lambda out: maps.append((sched.block_map(), expected_block_map(sched))))
    assert sched.num_preemptions_swap > 0
    assert all(got == want for got, want in maps)
    assert any(b.shared_prefix for got, _ in maps for b in got.host)
    assert any(b.shared_prefix for got, _ in maps for b in got.device)
