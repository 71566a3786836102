"""`GET /v1/kv_cache`'s JSON read back into a block map (`block_map_from_kv_cache_json`), as the
app does for a remote PagedChat server: a round trip on a real tiny engine, and malformed bodies."""
from __future__ import annotations

import copy
import json

import pytest

from engine import BlockMap, BlockState, LLMEngine, SamplingParams, block_map_from_kv_cache_json
from engine.api.kv_cache import kv_cache_json
from ui.panel import block_grid
from ui.panel.view import block_map_html


def check_round_trip(engine: LLMEngine) -> BlockMap:
    info, stats, block_map = engine.info(), engine.stats(), engine.block_map()
    body = json.loads(json.dumps(kv_cache_json(info, stats, block_map)))  # as it crosses the wire
    back, back_info = block_map_from_kv_cache_json(body, device="10.0.0.2:8000")
    assert back.block_size == block_map.block_size
    for pool, original in (("device", block_map.device), ("host", block_map.host)):
        rebuilt = getattr(back, pool)
        assert len(rebuilt) == len(original), pool
        for a, b in zip(original, rebuilt):
            assert (b.block_id, b.state, b.ref_count, b.shared_prefix) == (a.block_id, a.state, a.ref_count,
                                                                            a.shared_prefix), (pool, a, b)
            assert b.owners == a.owners[:1]  # the JSON carries a block's first owner only
            assert b.block_hash is None and b.num_tokens == 0
        assert block_grid.summary_of(rebuilt) == block_grid.summary_of(original), pool
    assert (back_info.model, back_info.block_size, back_info.max_model_len) == (info.model, info.block_size,
                                                                                 info.max_model_len)
    assert (back_info.num_device_blocks, back_info.num_host_blocks) == (info.num_device_blocks, info.num_host_blocks)
    assert back_info.device == "10.0.0.2:8000" and not back_info.on_cpu
    assert back_info.config == info.config and info.config.scheduler.block_size == info.block_size
    assert kv_cache_json(back_info, stats, back) == body  # encoding the rebuilt map gives the same JSON
    return back


def test_round_trip_on_a_running_engine_with_shared_cached_and_swapped_blocks(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, num_gpu_blocks=12, num_cpu_blocks=16, block_size=4, preemption_mode="swap")
    system = list(range(100, 120))  # 5 full blocks every request below starts with
    engine.add_request("warm/1", system + [5], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    check_round_trip(engine)  # idle: the warm-up's blocks are cached
    engine.add_request("a/1", system + [7, 8], SamplingParams(max_tokens=30, ignore_eos=True, n=2))
    engine.add_request("b/1", system + [9], SamplingParams(max_tokens=30, ignore_eos=True))
    seen: dict[str, set[str]] = {"device": set(), "host": set()}
    while engine.has_unfinished():
        engine.step()
        back = check_round_trip(engine)
        for pool in seen:
            seen[pool] |= {block_grid.state_of(b) for b in getattr(back, pool)}
    # the run had prefix hits (shared), its own blocks, cached and free ones, and swaps to the host
    assert seen["device"] == {"free", "cached", "used", "shared"} and "used" in seen["host"]


def test_round_trip_carries_which_blocks_hold_a_preset_system_prompt(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, num_gpu_blocks=32, num_cpu_blocks=8, block_size=4)
    preset = {"role": "system", "content": "You are a helpful, concise assistant. Answer clearly."}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for user in ("ada", "bob"):
        engine.add_request(f"{user}/1", [preset, {"role": "user", "content": f"Hello, I am {user}"}], params,
                           cache_salt=user, num_shared_messages=1)
    engine.step()
    back = check_round_trip(engine)
    flags = [b.shared_prefix for b in back.device]
    assert any(flags) and not all(b.shared_prefix for b in back.device if b.state is BlockState.USED)


def test_a_body_without_the_shared_prefix_field_reads_with_no_block_flagged():
    assert "shared_prefix" not in GOOD["device"]  # as an older PagedChat server sends it
    block_map, _ = block_map_from_kv_cache_json(GOOD)
    assert not any(b.shared_prefix for b in block_map.device + block_map.host)
    body = changed("device.shared_prefix", [[1, 1], [0, 2]])
    assert [b.shared_prefix for b in block_map_from_kv_cache_json(body)[0].device] == [True, False, False]


def test_the_rebuilt_map_renders_with_the_panels_block_map():
    body = {"model": "m", "block_size": 16, "max_model_len": 2048,
            "device": {"num_blocks": 4, "used": 3, "cached": 1, "states": "uuuc",
                       "ref_counts": [[2, 1], [1, 2], [0, 1]], "owners": [[0, 2], [1, 1], [-1, 1]]},
            "host": {"num_blocks": 2, "used": 0, "states": "ff", "ref_counts": [[0, 2]], "owners": [[-1, 2]]},
            "requests": ["<b>x</b>/1", "y/1"], "running": 2, "waiting": 0, "swapped": 0}
    block_map, info = block_map_from_kv_cache_json(body)
    assert [b.owners for b in block_map.device] == [("<b>x</b>/1",), ("<b>x</b>/1",), ("y/1",), ()]
    assert [b.state for b in block_map.device] == [BlockState.USED] * 3 + [BlockState.CACHED]
    page = block_map_html(block_map, info, show_private=True)
    assert 'data-pool="device"' in page and 'data-shared="1"' in page and 'data-used="2"' in page
    assert 'data-cached="1"' in page and "Device pool (remote)" in page
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;/1" in page
    empty = dict(body, host={"num_blocks": 0, "states": "", "ref_counts": [], "owners": []})
    assert block_map_from_kv_cache_json(empty)[0].host == ()


GOOD = {"model": "m", "block_size": 16, "max_model_len": 64,
        "device": {"num_blocks": 3, "used": 1, "cached": 1, "states": "ucf",
                   "ref_counts": [[1, 1], [0, 2]], "owners": [[0, 1], [-1, 2]]},
        "host": {"num_blocks": 1, "used": 0, "states": "f", "ref_counts": [[0, 1]], "owners": [[-1, 1]]},
        "requests": ["a/1"], "running": 1, "waiting": 0, "swapped": 0}


def changed(path: str, value) -> dict:
    body = copy.deepcopy(GOOD)
    *parents, key = path.split(".")
    target = body
    for parent in parents:
        target = target[parent]
    if value is KeyError:
        del target[key]
    else:
        target[key] = value
    return body


def test_a_good_body_reads():
    block_map, info = block_map_from_kv_cache_json(GOOD)
    assert [b.state for b in block_map.device] == [BlockState.USED, BlockState.CACHED, BlockState.FREE]
    assert info.num_device_blocks == 3 and info.num_host_blocks == 1


@pytest.mark.parametrize("body, message", [
    (changed("device.ref_counts", [[1, 1], [0, 1]]), r"device\.ref_counts: runs add up to 2 blocks, num_blocks is 3"),
    (changed("device.owners", [[0, 1], [-1, 5]]), r"device\.owners: runs add up to 6 blocks, num_blocks is 3"),
    (changed("host.ref_counts", [[0, 10**15]]), r"host\.ref_counts: runs add up to 1000000000000000 blocks"),
    (changed("device.states", "ucx"), r"device\.states: unknown state letter\(s\) 'x'"),
    (changed("device.states", "uc"), r"device\.states: 2 letters for num_blocks=3"),
    (changed("device.owners", [[1, 1], [-1, 2]]), r"device\.owners: owner index 1 out of range \(1 requests\)"),
    (changed("device.owners", [[-2, 1], [-1, 2]]), r"device\.owners\[0\]: expected \[value >= -1"),
    (changed("device.ref_counts", [[-1, 3]]), r"device\.ref_counts\[0\]: expected \[value >= 0"),
    (changed("device.shared_prefix", [[2, 3]]), r"device\.shared_prefix\[0\]: expected \[value 0\.\.1"),
    (changed("device.shared_prefix", [[1, 2]]), r"device\.shared_prefix: runs add up to 2 blocks, num_blocks is 3"),
    (changed("host.shared_prefix", "yes"), r"host\.shared_prefix: expected a list"),
    (changed("device.ref_counts", [[1, 0], [0, 3]]), r"device\.ref_counts\[0\]: .*run length >= 1"),
    (changed("device.ref_counts", [[1, 1, 1], [0, 2]]), r"device\.ref_counts\[0\]"),
    (changed("device.ref_counts", [["1", 1], [0, 2]]), r"device\.ref_counts\[0\]"),
    (changed("device.ref_counts", {"1": 3}), r"device\.ref_counts: expected a list"),
    (changed("device.owners", KeyError), r"device\.owners: expected a list"),
    (changed("device.num_blocks", "3"), r"device\.num_blocks: expected an integer"),
    (changed("device.num_blocks", True), r"device\.num_blocks: expected an integer"),
    (changed("config", {"model": "m"}), r"kv_cache\.config: not an engine configuration"),
    (changed("config", {"scheduler": {"num_device_blocks": 0}}), r"kv_cache\.config: not an engine configuration"),
    (changed("host", None), r"kv_cache\.host: expected an object"),
    (changed("block_size", 0), r"kv_cache\.block_size: expected an integer of at least 1"),
    (changed("requests", [1]), r"kv_cache\.requests: expected a list of request id strings"),
    (changed("max_model_len", "long"), r"kv_cache\.max_model_len"),
    ([], r"kv_cache: expected a JSON object, got list"),
])
def test_a_malformed_body_says_what_is_wrong(body, message):
    with pytest.raises(ValueError, match=message):
        block_map_from_kv_cache_json(body)
