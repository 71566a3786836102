"""Prefix caching through the scheduler: shared system prompts, later turns, LRU order; the
block hash, xxh3 or sha256, through the scheduler, the engine and `engine.serve`'s flag."""
import hashlib
import struct

import httpx
import pytest

from engine.core.block_hash import extend_block_hashes, hash_block
from engine.core.block_map import BlockState
from engine_servers import EngineServer
from simulation import expected, make, request, run

SYSTEM = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # three blocks of 4


def test_hash_chains_the_parent():
    assert hash_block(0, [1, 2]) == hash_block(0, [1, 2])
    assert hash_block(0, [1, 2]) != hash_block(hash_block(0, [3, 4]), [1, 2])
    hashes: list[int] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], 2, 2)
    assert hashes == [hash_block(0, [1, 2]), hash_block(hash_block(0, [1, 2]), [3, 4])]


def test_chats_sharing_a_system_prompt_hit_while_the_first_still_runs():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("a", SYSTEM + [30, 31], max_tokens=20, ignore_eos=True))
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    sched.add_request(request("b", SYSTEM + [40, 41, 42], max_tokens=20, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    a, b = sched.requests["a"], sched.requests["b"]
    assert b.num_cached_tokens == len(SYSTEM)
    assert a.block_ids[:3] == b.block_ids[:3]
    shared = [info for info in sched.block_map().device if info.block_id in b.block_ids[:3]]
    assert all(info.ref_count == 2 and set(info.owners) == {"a", "b"} for info in shared)
    assert sched.last_stats.prefix_cache_hits == len(SYSTEM)
    assert sched.last_stats.prefix_cache_queries == len(SYSTEM) + 2 + len(SYSTEM) + 3


def test_new_chat_hits_the_system_prompt_after_the_first_finished():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("a", SYSTEM + [30, 31], max_tokens=5, ignore_eos=True))
    run(sched, runner)
    sched.add_request(request("b", SYSTEM + [40], max_tokens=5, ignore_eos=True))
    done = run(sched, runner)
    assert done["b"].num_cached_tokens == len(SYSTEM)


def test_turn_two_hits_turn_one():
    sched, runner = make(num_device_blocks=32)
    turn1 = request("t1", SYSTEM + [30, 31, 32], max_tokens=7, ignore_eos=True)
    sched.add_request(turn1)
    run(sched, runner)
    history = turn1.all_token_ids  # prompt + reply: 15 + 7 = 22 tokens
    sched.add_request(request("t2", history + [33, 34], max_tokens=3, ignore_eos=True))
    done = run(sched, runner)
    # Turn 1 computed KV for all but its last sampled token: 21 tokens, five full blocks.
    assert done["t2"].num_cached_tokens == 20


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("a", SYSTEM, max_tokens=3, ignore_eos=True))
    run(sched, runner)
    a_blocks = sched.kv.device.registered()
    sched.add_request(request("b", SYSTEM, max_tokens=3, ignore_eos=True))
    out = sched.schedule()
    # two blocks hit whole; the third is a's third block copied, all but its last token
    assert out.scheduled[0].start == 11 and out.scheduled[0].num_new_tokens == 1
    assert sched.requests["b"].num_cached_tokens == 11
    third = sched.requests["b"].block_hashes[1]
    src = next(b.block_id for b in a_blocks.values() if b.parent_hash == third)
    assert out.blocks_to_copy == [(src, sched.requests["b"].block_ids[2])]
    sched.update(out, runner.execute(out))  # the runner checks b reads a's tokens back


def test_caching_off_never_hits():
    sched, runner = make(num_device_blocks=32, enable_prefix_caching=False)
    for rid in ("a", "b"):
        sched.add_request(request(rid, SYSTEM + [1], max_tokens=3, ignore_eos=True))
        done = run(sched, runner)
        assert done[rid].num_cached_tokens == 0
    assert sched.kv.device.num_cached_free == 0
    assert all(info.state is BlockState.FREE for info in sched.block_map().device)


def test_free_queue_is_lru_with_tail_blocks_before_head_blocks():
    sched, runner = make(num_device_blocks=16)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], max_tokens=1)
    sched.add_request(a)
    run(sched, runner)
    b = request("b", [21, 22, 23, 24, 25, 26, 27, 28, 29], max_tokens=1)
    sched.add_request(b)
    run(sched, runner)
    # a's three full blocks were freed first (tail first), then b's two (tail first).
    _, cached = sched.kv.device.free_queue_ids()
    a_blocks = [sched.kv.device.lookup(h).block_id for h in a.block_hashes[:3]]
    b_blocks = [sched.kv.device.lookup(h).block_id for h in b.block_hashes[:2]]
    assert cached == a_blocks[::-1] + b_blocks[::-1]
    # Reusing a's head block makes it the most recently used once its new owner is done.
    sched.add_request(request("c", [1, 2, 3, 4, 99], max_tokens=1))
    run(sched, runner)
    _, cached = sched.kv.device.free_queue_ids()
    assert cached[-1] == a_blocks[0]
    # Under pressure the least recently used (a's tail) is evicted first.
    pool = sched.kv.device
    while pool.num_free > pool.num_cached_free:
        pool.allocate()
    first_evicted = pool.allocate()
    assert first_evicted.block_id == a_blocks[2]
    assert pool.lookup(a.block_hashes[2]) is None and pool.lookup(a.block_hashes[1]) is not None


def test_chats_arriving_together_compute_a_shared_system_prompt_once():
    sched, runner = make(num_device_blocks=64, max_num_batched_tokens=256)
    for i in range(4):
        sched.add_request(request(f"c{i}", SYSTEM + [40 + i, 41 + i], max_tokens=3, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert [s.request_id for s in out.scheduled] == ["c0"]  # the rest wait one step for its blocks
    done = run(sched, runner)
    assert [done[f"c{i}"].num_cached_tokens for i in range(1, 4)] == [len(SYSTEM)] * 3
    assert sched.last_stats.prefix_cache_hits == 3 * len(SYSTEM)


def test_a_long_shared_prompt_in_chunks_is_still_computed_once():
    long_system = list(range(5, 45))  # 10 blocks, prefilled in chunks of 8 tokens
    sched, runner = make(num_device_blocks=64, max_num_batched_tokens=8)
    sched.add_request(request("a", long_system + [1], max_tokens=2, ignore_eos=True))
    sched.add_request(request("b", long_system + [2], max_tokens=2, ignore_eos=True))
    computed = {"a": 0, "b": 0}
    run(sched, runner, on_step=lambda out: [computed.__setitem__(s.request_id, computed[s.request_id] + s.num_new_tokens)
                                            for s in out.scheduled])
    assert computed["b"] <= 4 + 2  # its last partial block and decode only


def _cached_after(sched, runner, rid: str, prompt: list[int], salt, shared: int) -> int:
    sched.add_request(request(rid, prompt, max_tokens=2, ignore_eos=True, cache_salt=salt,
                              num_shared_prefix_tokens=shared))
    done = run(sched, runner)
    return done[rid].num_cached_tokens


def test_a_salted_prompt_shares_only_the_blocks_wholly_inside_the_shared_prefix():
    sched, runner = make(num_device_blocks=64)
    # 10 shared tokens over blocks of 4: blocks 0-1 are shared, block 2 straddles the boundary
    # (2 shared tokens, then the user's) and is the user's, like everything after it.
    prompt = SYSTEM[:10] + [40, 41, 42, 43, 44, 45, 46, 47, 48]
    # After the full blocks, a cached block that begins with the next tokens is copied: across
    # users only its tokens inside the preset (block 2's first two), within a user all of them.
    assert _cached_after(sched, runner, "ada-1", prompt, "ada", 10) == 0
    assert _cached_after(sched, runner, "ada-2", prompt, "ada", 10) == 18  # her own four full blocks, 2 of the 5th
    assert _cached_after(sched, runner, "bob-1", prompt, "bob", 10) == 10  # the preset's two blocks and 2 tokens
    assert _cached_after(sched, runner, "anon", prompt, None, 0) == 10     # unsalted: the preset, not theirs
    assert _cached_after(sched, runner, "bob-2", prompt, "bob", 10) == 18  # bob's own, now cached


def test_the_same_text_from_another_user_never_hits_even_with_no_shared_prefix():
    sched, runner = make(num_device_blocks=64)
    prompt = SYSTEM + [50, 51]
    assert _cached_after(sched, runner, "u1", prompt, "u1", 0) == 0
    assert _cached_after(sched, runner, "u2", prompt, "u2", 0) == 0
    assert _cached_after(sched, runner, "u1-again", prompt, "u1", 0) == 12
    hashes = {info.block_hash for info in sched.block_map().device if info.block_hash is not None}
    assert len(hashes) == 6  # three blocks each, none in common


def test_forked_samples_keep_their_parents_salt():
    sched, runner = make(num_device_blocks=64)
    prompt = SYSTEM + [60, 61, 62]
    sched.add_request(request("p", prompt, max_tokens=9, ignore_eos=True, n=2, cache_salt="ada",
                              num_shared_prefix_tokens=8))
    done = run(sched, runner)
    child = done["p#1"]
    assert child.cache_salt == "ada" and child.num_shared_prefix_tokens == 8
    # The child's own later blocks were registered under ada's salt: ada hits them, bob does not.
    long_prompt = prompt + child.output_token_ids
    assert _cached_after(sched, runner, "ada-2", long_prompt, "ada", 8) > 12
    assert _cached_after(sched, runner, "bob", long_prompt, "bob", 8) == 8


@pytest.mark.parametrize("algo", ["xxh3", "sha256"])
def test_a_shared_prefix_hits_with_either_hash(algo):
    sched, runner = make(num_device_blocks=32, prefix_caching_hash_algo=algo)
    sched.add_request(request("a", SYSTEM + [30, 31], max_tokens=5, ignore_eos=True))
    run(sched, runner)
    sched.add_request(request("b", SYSTEM + [40], max_tokens=5, ignore_eos=True))
    assert run(sched, runner)["b"].num_cached_tokens == len(SYSTEM)
    # and a salted prompt only its own user's, past the shared prefix (as with the default hash)
    prompt = SYSTEM[:8] + [40, 41, 42, 43, 44, 45, 46, 47, 48]
    assert _cached_after(sched, runner, "ada-1", prompt, "ada", 8) == 8
    assert _cached_after(sched, runner, "bob-1", prompt, "bob", 8) == 8
    assert _cached_after(sched, runner, "ada-2", prompt, "ada", 8) == 16


def test_the_sha256_chain_is_sha256_of_the_parent_and_the_tokens():
    """A block's sha256 hash is the digest of its parent's 32-byte digest (zeros for the first
    block), its token ids as little-endian int64, and, when salted, b"\\0salt\\0" and the salt."""
    tokens, salt = list(range(100, 148)), "ada@example.com"
    chain: list[int] = []
    extend_block_hashes(chain, tokens, 16, 3, salt, salt_from=1, algo="sha256")
    parent, expected = bytes(32), []
    for i in range(3):
        data = parent + struct.pack("<16q", *tokens[16 * i:16 * (i + 1)])
        if i == 1:
            data += b"\0salt\0" + salt.encode()
        parent = hashlib.sha256(data).digest()
        expected.append(int.from_bytes(parent, "little"))
    assert chain == expected
    assert hash_block(0, tokens[:16], algo="sha256") == expected[0]


@pytest.mark.parametrize("algo", ["xxh3", "sha256"])
def test_different_salts_never_share_a_hash(algo):
    tokens = list(range(16))
    unsalted = hash_block(0, tokens, algo=algo)
    salted = {hash_block(0, tokens, f"user-{i}", algo=algo) for i in range(5000)}
    assert len(salted) == 5000 and unsalted not in salted
    assert hash_block(0, tokens, "", algo=algo) != unsalted  # an empty salt is still a salt


def test_the_engine_hashes_blocks_with_sha256_when_asked(tiny_model_dir):
    from engine import LLM, SamplingParams

    llm = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=32, num_cpu_blocks=0,
              prefix_caching_hash_algo="sha256")
    prompt = list(range(5, 5 + 40))
    first, second = (llm.generate([prompt], SamplingParams(max_tokens=2))[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    hashes = [info.block_hash for info in llm.block_map().device if info.block_hash is not None]
    assert hashes and max(hashes) >= 2 ** 128  # 256-bit digests, not xxh3's 128 bits
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=32, prefix_caching_hash_algo="md5")


def test_the_server_takes_the_hash_flag_and_hits_the_prefix(tiny_model_dir, tmp_path):
    """`python -m engine.serve --prefix-caching-hash-algo sha256` (the app takes the same flag)."""
    server = EngineServer(tiny_model_dir, tmp_path)
    server.options += ["--prefix-caching-hash-algo", "sha256"]
    server.start(timeout=180)
    try:
        body = {"model": "tiny", "prompt": "a shared preamble that spans several blocks of tokens " * 4,
                "max_tokens": 2}
        cached = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
                  ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
        assert cached[0] == 0 and cached[1] >= 32
    finally:
        server.stop()


def test_a_new_chat_copies_the_cached_block_that_begins_with_its_next_tokens():
    # The system prompt ends 2 tokens into its third block: a new chat hits the two whole blocks,
    # then copies the first chat's third block and computes from its own first token on.
    sched, runner = make(num_device_blocks=32)
    system = SYSTEM[:10]
    sched.add_request(request("a", system + [30, 31, 32], max_tokens=3, ignore_eos=True))
    run(sched, runner)
    a_third = next(b for b in sched.kv.device.registered().values() if b.token_ids[:2] == tuple(system[8:]))
    b = request("b", system + [40, 41, 42], max_tokens=5, ignore_eos=True)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 10 and out.scheduled[0].start == 10 and out.scheduled[0].num_new_tokens == 3
    assert out.blocks_to_copy == [(a_third.block_id, b.block_ids[2])] and b.block_ids[2] != a_third.block_id
    assert out.scheduled[0].new_block_ids == b.block_ids[2:] and len(b.block_ids) == 4
    assert sched.kv.device.blocks[a_third.block_id].ref_count == 0  # held only while the step was planned
    sched.update(out, runner.execute(out))  # the runner checks b reads the copied tokens back
    done = run(sched, runner)
    assert done["b"].output_token_ids == expected(b, sched.config.max_model_len)
    assert sched.last_stats.prefix_cache_hits == 10


def test_no_copy_when_holding_its_source_would_take_the_last_free_block():
    # Three blocks in all, two of them the first chat's cached ones: the second chat needs all
    # three, so it takes the whole first block, computes the rest (no copy) and still finishes.
    sched, runner = make(num_device_blocks=3)
    sched.add_request(request("a", [1, 2, 3, 4, 5, 6], max_tokens=3, ignore_eos=True))
    run(sched, runner)
    b = request("b", [1, 2, 3, 4, 5, 6, 70, 71, 72, 73, 74], max_tokens=1, ignore_eos=True)
    sched.add_request(b)
    out = sched.schedule()
    assert out.blocks_to_copy == [] and b.num_cached_tokens == 4 and out.scheduled[0].start == 4
    sched.update(out, runner.execute(out))
    done = run(sched, runner)
    assert done["b"].output_token_ids == expected(b, sched.config.max_model_len)


def test_a_partial_match_compares_tokens_and_stops_at_the_first_difference():
    sched, runner = make(num_device_blocks=32)
    sched.add_request(request("a", SYSTEM[:8] + [30, 31, 32, 33, 34], max_tokens=2, ignore_eos=True))
    run(sched, runner)
    for tail, shared in (([30, 99, 32, 33, 34], 1), ([30, 31, 32, 99, 34], 3), ([99, 31, 32, 33, 34], 0)):
        b = request(f"b{tail[1]}{tail[3]}", SYSTEM[:8] + tail, max_tokens=2, ignore_eos=True)
        sched.add_request(b)
        done = run(sched, runner)
        assert done[b.request_id].num_cached_tokens == 8 + shared
        assert done[b.request_id].output_token_ids == expected(b, sched.config.max_model_len)
