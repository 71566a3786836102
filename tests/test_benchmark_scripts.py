"""The benchmark scripts still run and end with their JSON line (figures are not asserted:
speed is shown by the benchmarks themselves, in BENCHMARKS.md)."""
import json
import sys
from pathlib import Path

from preloaded_python import run_python

ROOT = Path(__file__).parent.parent


def last_json_line(args):
    done = run_python(args, ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_step_profile_script(tiny_model_dir):
    done = run_python(["benchmarks/step_profile.py", "--model", tiny_model_dir, "--tokens", "4", "--ops", "3"], ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    parts = figures["ms_per_step"]
    assert figures["tok_s"] > 0 and parts["step"] >= parts["forward"] >= parts["weight matmuls"] > 0
    table = lines[lines.index(next(line for line in lines if line.startswith("op "))) + 1:-1]
    assert len(table) == 3 and all("::" in line.split()[0] and float(line.split()[1]) >= 0 for line in table)


def test_gpu_step_script_on_the_cpu(tiny_model_dir):
    """Its device figures need CUDA; on a CPU the same steps run and report their wall times."""
    done = run_python(["benchmarks/gpu_step.py", "--device", "cpu", "--model", tiny_model_dir, "--chats", "4",
                       "--steps", "4", "--mixed-rounds", "1", "--no-compile", "--profile", "3"], ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["chats"] == 4 and figures["step_ms_p50"] > 0 and figures["weights_read_ms"] is None
    assert {"scheduler.schedule", "runner.execute", "output processor"} <= set(figures["host_ms_mean"])
    assert set(figures["eager_decode"]) == {"fused layer ops", "torch's ops"}
    assert set(figures["mixed"]) == {"25 graphs", "25 eager", "128 graphs", "128 eager"}
    assert all(m["ms_p50"] > 0 and m["paths"] for m in figures["mixed"].values())
    assert "Own time over 4 decode steps" in done.stdout


VARIANT_FILE = """
import kernels
from engine.worker.models import llama

def VARIANTS(model, inputs):
    input_ids, positions, kv_cache, meta, logits_indices = inputs
    # a decode step of both chats, through torch's attention or (float32 on a CPU) the native rows
    assert input_ids.shape[0] == 2 and (meta.plan is not None or meta.row_contexts is not None)

    def replace(attention):
        original, native = kernels.paged_attention, model.row_attention
        kernels.paged_attention = attention
        if native is not None:
            model.row_attention = attention
        def undo():
            kernels.paged_attention, model.row_attention = original, native
        return undo

    def same():
        chosen = model.row_attention if meta.row_contexts is not None else kernels.paged_attention
        return replace(lambda *args, **kwargs: chosen(*args, **kwargs))

    def no_attention():
        return replace(lambda q, *args, **kwargs: q.clone())

    return {"same": same, "no attention": no_attention}
"""


def test_forward_ab_script(tiny_model_dir, tmp_path):
    variant = tmp_path / "variant.py"
    variant.write_text(VARIANT_FILE)
    figures = last_json_line(["benchmarks/forward_ab.py", "--model", tiny_model_dir, "--chats", "2", "--tokens", "8",
                              "--step", "5", "--rounds", "2", "--repeat", "1", "--variant", str(variant)])
    sides = figures["sides"]
    assert figures["base_unchanged"]  # the variants' undos ran
    assert list(sides) == ["base", "same", "no attention"]
    assert sides["base"]["vs_base"] == 1.0 and sides["base"]["max_abs_diff"] == 0.0
    assert sides["same"]["max_abs_diff"] == 0.0 and sides["same"]["same_greedy"]
    # Without attention the logits change: the check sees it.
    assert sides["no attention"]["max_abs_diff"] > 0
    assert all(len(side["ms"]) == 2 and min(side["ms"]) > 0 for side in sides.values())


def test_forward_ab_script_refuses_a_file_without_variants(tiny_model_dir, tmp_path):
    variant = tmp_path / "empty.py"
    variant.write_text("def VARIANTS(model, inputs):\n    return {}\n")
    done = run_python(["benchmarks/forward_ab.py", "--model", tiny_model_dir, "--tokens", "8", "--step", "5",
                       "--variant", str(variant)], ROOT)
    assert done.returncode != 0 and "must return a non-empty dict" in done.stderr
    # A file with no VARIANTS at all is refused before a model loads (this one does not exist).
    (tmp_path / "none.py").write_text("VARIANT = {}\n")
    done = run_python(["benchmarks/forward_ab.py", "--model", str(tmp_path / "no-model"), "--variant",
                       str(tmp_path / "none.py")], ROOT)
    assert done.returncode != 0 and "defines no VARIANTS(model, inputs)" in done.stderr, done.stderr[-2000:]


def test_scheduler_overhead_script():
    figures = last_json_line(["benchmarks/scheduler_overhead.py", "--steps", "5", "--requests", "8"])
    assert figures["ms_per_step"] > 0 and figures["requests"] == 8


def test_block_map_script():
    figures = last_json_line(["benchmarks/block_map.py", "--pools", "2000", "--requests", "8", "--steps", "3"])
    assert figures["pools"]["2000"]["engine_ms"] > 0 and figures["requests"] == 8


def test_kernels_script_small():
    figures = last_json_line(["benchmarks/kernels.py", "--small"])
    assert figures["small"] is True
    assert {"decode_attention_gbs", "copy_gbs", "prefill_vs_sdpa", "swap_out_gbs", "swap_in_gbs"} <= set(figures)


def test_throughput_script_random_tiny():
    """The GPU benchmark's path (random Llama built from a config, only systems (c) and (d)) on tiny
    shapes on the CPU."""
    figures = last_json_line(["benchmarks/throughput.py", "--model", "random-llama-tiny", "--systems", "c,d",
                              "--chats", "4", "--output-tokens", "8", "--skip-ttft", "--roofline-n", "256"])
    assert figures["hf_generate_batch_tok_s"] > 0 and figures["engine_tok_s"] > 0
    assert figures["engine_vs_hf_generate_batch"] > 0
    assert figures["model"] == "random-llama-tiny" and figures["num_parameters"] > 1_000_000
    assert figures["systems"] == "cd" and figures["device"] == "cpu"
    assert figures["roofline_n"] == 256 and figures["measured_gflops"] > 0 and figures["roofline_share"] > 0
    assert figures["chats"] == 4 and figures["output_tokens"] == 8 and figures["incomplete_systems"] == []
    assert "hf_batch_tok_s" not in figures and "ttft_cached_s" not in figures


def test_soak_script_short(tiny_model_dir):
    """The soak's short run: real gradio_client users against the app in a child process, some
    leaving mid-reply and some sending bad input; nothing may be lost, leaked or left hanging."""
    figures = last_json_line(["benchmarks/soak.py", "--users", "4", "--minutes", "0.15", "--model", tiny_model_dir,
                              "--think-s", "0.3", "--leave-share", "0.25", "--bad-share", "0.15", "--hang-s", "60",
                              "--ramp-s", "1"])
    assert figures["replies_finished"] > 0 and figures["left_mid_reply"] + figures["bad_input_refused"] > 0
    assert figures["replies_lost"] == 0 and figures["hung"] == 0 and figures["errors"] == 0, figures["error_kinds"]
    assert figures["blocks_left"] == 0 and figures["requests_left"] == 0
    assert figures["page_loads"] > 0 and figures["page_load_p99_s"] is not None


RATE_FIELDS = {"rate", "exact", "sent", "follow_ups", "completed", "failed", "errors", "wall_s", "req_per_s", "output_tok_s",
               "output_tokens_from", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "good", "goodput_req_s",
               "good_share", "ttft_missed", "itl_missed", "client_cpu_s", "client_cpu_share", "cached_share", "window"}


def check_rate_row(row):
    """A rate's figures: every request answered, and goodput consistent with the counts."""
    assert set(row) == RATE_FIELDS, set(row) ^ RATE_FIELDS
    assert row["sent"] > 0 and row["completed"] == row["sent"] and row["failed"] == 0, row
    assert row["output_tok_s"] > 0 and row["ttft_p50_s"] > 0 and row["itl_p50_ms"] is not None
    assert 0 <= row["good"] <= row["completed"]
    # A request that was not good missed the TTFT or the ITL bar (or both).
    assert max(row["ttft_missed"], row["itl_missed"]) <= row["completed"] - row["good"] <= \
        row["ttft_missed"] + row["itl_missed"]
    assert row["good_share"] == round(row["good"] / row["sent"], 3)
    # goodput and completed/s share the wall time: their ratio is good / completed
    assert row["goodput_req_s"] <= row["req_per_s"]
    assert abs(row["goodput_req_s"] * row["completed"] - row["req_per_s"] * row["good"]) < 0.01 * row["completed"]
    assert row["window"][1] - row["window"][0] >= row["wall_s"] - 0.1  # the arrivals and their replies
    assert 0 < row["client_cpu_s"] < row["wall_s"]  # the client's own CPU, a small share of the run
    assert row["cached_share"] > 0  # the shared preset prompts come from the prefix cache


def test_serve_script_short(tiny_model_dir):
    """The HTTP load generator against a real `python -m engine.serve` it starts: Poisson arrivals,
    shared system prompts and follow-up turns, streamed through the OpenAI API by its own small
    HTTP client; then one chat alone. Arrivals go on past the duration until the rate has its
    least count of requests (4 s at 4/s hold about 16)."""
    figures = last_json_line(["benchmarks/serve.py", "--model", tiny_model_dir, "--num-gpu-blocks", "128",
                              "--rates", "4", "--duration-s", "4", "--max-tokens", "8", "--one-chat-tokens", "24"])
    assert figures["protocol"] == "openai" and figures["ttft_slo_s"] == 1.0 and figures["itl_slo_ms"] == 200.0
    [row] = figures["rates"]
    check_rate_row(row)
    assert figures["min_requests"] == 20 and row["sent"] >= 20
    assert row["output_tokens_from"] == "usage" and row["exact"]  # every reply max_tokens long
    alone = figures["one_chat"]  # EOS ignored: all 24 tokens
    assert alone["ok"] and alone["tokens"] == 24 and alone["tok_s"] > 0 and alone["output_tokens_from"] == "usage"


def test_serve_script_gradio_protocol(tiny_model_dir, tmp_path):
    """The same trace through the chat page's `send` event on Gradio's queue (the app served in
    this process): every reply arrives, follow-up turns land in their own conversation, and the
    output tokens are counted by re-tokenizing the replies."""
    from served_app import served_chat

    with served_chat(tiny_model_dir, tmp_path / "chats.db", num_gpu_blocks=128, num_cpu_blocks=64) as (_, store, url):
        figures = last_json_line(["benchmarks/serve.py", "--protocol", "gradio", "--page-url", url, "--rates", "4",
                                  "--duration-s", "4", "--max-tokens", "8", "--one-chat-tokens", "16"])
        conversations = store.db.execute("select count(*) from conversations").fetchone()[0]
        asked = store.db.execute("select count(*) from messages where role = 'user'").fetchone()[0]
    [row] = figures["rates"]
    check_rate_row(row)
    assert row["output_tokens_from"] == "retokenized" and not row["exact"]  # the page has no ignore_eos
    # One stored question per request (and the chat alone's); a follow-up adds none of its own chats.
    assert asked == row["sent"] + 1 and conversations == row["sent"] - row["follow_ups"] + 1
    alone = figures["one_chat"]
    assert alone["ok"] and alone["tokens"] > 0 and alone["chunks"] >= 1


def test_peer_comparison_script_runs_the_engine_and_reports_peers_not_set_up(tmp_path):
    """`make bench-peers`'s script on the embedded model, pointed at an empty build folder: the
    engine's figures, and vLLM and llama.cpp reported missing with what to run, not a crash."""
    figures = last_json_line(["benchmarks/peers/compare.py", "--dtypes", "float32", "--output-tokens", "2",
                              "--rounds", "2", "--chats", "2", "--build", str(tmp_path)])
    assert figures["chats"] == 2 and len(json.loads((tmp_path / "workload.json").read_text())["prompts"]) == 2
    row = figures["float32"]
    assert row["engine_tok_s"] > 0 and row["engine_single_tok_s"] > 0 and row["engine_startup_s"] > 0
    runs = row["engine_tok_s_rounds"]  # two rounds, their median reported
    assert len(runs) == 2 and row["engine_tok_s"] == round((runs[0] + runs[1]) / 2, 2) and figures["rounds"] == 2
    assert 0 < row["engine_single_bound_share"] and figures["read_gb_s"] > 0
    assert "vllm_cpu.sh setup" in row["missing"]["vllm"] and "llama_cpp.sh" in row["missing"]["llamacpp"]


def test_serve_comparison_script_runs_the_engine_and_reports_peers_not_set_up(tiny_model_dir, tmp_path):
    """`make bench-serve`'s script, ours on the tiny model, pointed at an empty build folder: the
    engine's rates (climbing in increasing order) and its one chat, the peers reported missing
    with what to run, and the JSON line's shape."""
    figures = last_json_line(["benchmarks/peers/serve_compare.py", "--systems", "engine,vllm,llamacpp,llamacpp_q4_1",
                              "--model", tiny_model_dir, "--dtype", "float32", "--rates", "3,1", "--past-limit", "2",
                              "--duration-s", "1", "--min-requests", "3", "--max-tokens", "8", "--one-chat-tokens", "12",
                              "--build", str(tmp_path)])
    assert figures["dtype"] == "float32" and figures["cpu"] and figures["rates_asked"] == [1.0, 3.0]
    engine = figures["systems"]["engine"]
    rows = engine["rates"]
    assert rows and rows[0]["rate"] == 1.0, engine
    for row in rows:
        assert row["sent"] >= 3 and row["good"] <= row["completed"] <= row["sent"]
        # On a fast host the tiny model's climb reaches hundreds a second, where the server refuses
        # what its queue cannot hold: a request that did not complete says why.
        assert row["completed"] == row["sent"] or row["errors"], row
    by_rate = {row["rate"]: row for row in rows}
    best, first_bad = engine["max_good_rate"], engine["first_unsustained_rate"]
    if best is None:  # not even the first rate: nothing more runs
        assert [row["rate"] for row in rows] == [1.0] and first_bad == 1.0 and engine["past_limit"] == []
    else:
        assert by_rate[best]["good_share"] >= 0.95
        assert engine["past_limit"] == [{"multiple": 2.0, "rate": best * 2, "good_share": by_rate[best * 2]["good_share"]}]
        if first_bad is None:
            assert best == 3.0 and engine["sustained_every_rate"]
        else:  # narrowed to within 1.25x of the limit
            assert by_rate[first_bad]["good_share"] < 0.95 and best < first_bad <= best * 1.25 * 1.0001
    assert engine["one_chat_tok_s"] > 0 and engine["one_chat"]["tokens"] == 12
    rounds = engine["one_chat"]["rounds_tok_s"]  # the median of three rounds, as the engine offline's
    assert len(rounds) == 3 and engine["one_chat_tok_s"] == sorted(rounds)[1]
    assert "--dtype float32" in engine["command"] and "compiled_wait_s" in engine
    if best is not None:  # the server's own steps while that rate ran, from its step log
        at_limit = engine["steps"]["max_good_rate"]
        assert at_limit["rate"] == best and at_limit["target_ms"] == 120.0
        assert sum(kind["steps"] for kind in at_limit["kinds"].values()) > 0
        assert any("every kind of step" in key for key in figures["goals"])
    systems = figures["systems"]
    assert "vllm_cpu.sh setup" in systems["vllm"]["missing"]
    assert "OUTTYPE=f32" in systems["llamacpp"]["missing"] and "llama-server" in systems["llamacpp_q4_1"]["missing"]
    assert figures["ratios"] == {}


def test_the_climb_narrows_the_limit_then_runs_past_it():
    """`serve.climb` on a system that sustains up to 5 requests/s: the asked rates until the
    first unsustained one, geometric means until the limit is bracketed within 1.25x, then the
    multiples of the highest sustained rate."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve

    ran = []

    def run(rate):
        ran.append(rate)
        return {"rate": rate, "good_share": 1.0 if rate <= 5 else 0.5}

    climbed = serve.climb(run, [1, 2, 4, 8, 16], past_limit=(1.5, 2))
    good, bad = climbed["max_good_rate"], climbed["first_unsustained_rate"]
    assert ran[:4] == [1, 2, 4, 8] and 16 not in ran
    assert good <= 5 < bad <= good * 1.25 * 1.0001 and all(4 < r < 8 for r in ran[4:-2])
    assert [p["rate"] for p in climbed["past_limit"]] == ran[-2:] == [round(good * 1.5, 3), round(good * 2, 3)]
    assert [row["rate"] for row in climbed["rows"]] == ran
    # Nothing sustained: no narrowing, nothing past the limit.
    ran.clear()
    assert climbed["dips"] == []
    assert serve.climb(run, [8, 16], past_limit=(2,)) == {"rows": [{"rate": 8, "good_share": 0.5}],
                                                          "max_good_rate": None, "first_unsustained_rate": 8,
                                                          "past_limit": [], "dips": []}


def test_a_dip_below_the_limit_does_not_end_the_climb():
    """A system that fails 2/s (one trace's burst) but sustains everything else up to 5/s: the
    first bracket (1–2) ends at 1.414, 1.5x it is sustained, so the climb goes on from there and
    finds the real limit; the rates past the limit are multiples of that one, and 2/s is a dip."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve

    ran = []

    def run(rate):
        ran.append(rate)
        return {"rate": rate, "good_share": 0.8 if rate == 2 or rate > 5 else 1.0}

    climbed = serve.climb(run, [1, 2, 4, 8], past_limit=(1.5, 2))
    good, bad = climbed["max_good_rate"], climbed["first_unsustained_rate"]
    assert good <= 5 < bad <= good * 1.25 * 1.0001
    assert [p["rate"] for p in climbed["past_limit"]] == [round(good * 1.5, 3), round(good * 2, 3)]
    assert all(p["good_share"] < 0.95 for p in climbed["past_limit"])
    assert climbed["dips"] == [2]
    assert len(ran) == len(set(ran)) and [row["rate"] for row in climbed["rows"]] == ran
    # A system whose every rate past the limit passes keeps rechecking only so often.
    ran.clear()
    bumpy = serve.climb(lambda rate: ran.append(rate) or {"rate": rate, "good_share": 0.8 if rate == 2 else 1.0},
                        [1, 2], past_limit=(1.5,), rechecks=1)
    assert bumpy["first_unsustained_rate"] is None and bumpy["dips"] == [2] and len(ran) < 12


def test_quantized_matrix_script_small():
    figures = last_json_line(["benchmarks/quantized_matrix.py", "--formats", "Q4_K,Q6_K", "--rows", "1,3",
                              "--out-features", "24", "--in-features", "256", "--repeats", "1"])
    assert [(r["format"], r["rows"]) for r in figures["results"]] == [("Q4_K", 1), ("Q4_K", 3), ("Q6_K", 1), ("Q6_K", 3)]
    assert all(set(r["ms"]) == {"one_level", "two_levels", "fp32", "bf16"} and min(r["ms"].values()) > 0
               for r in figures["results"])


def test_step_log_says_what_the_process_did_during_each_step(tiny_model_dir, tmp_path, monkeypatch):
    """$PAGEDCHAT_STEP_LOG: a line per step with its CPU time, page faults and preemptions, which
    benchmarks/step_log.py lists for the slowest steps (a step that waited for a preempted thread
    shows about one core's CPU time)."""
    from engine import LLMEngine
    from engine.core.sampling_params import SamplingParams

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PAGEDCHAT_STEP_LOG", str(log))
    engine = LLMEngine(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=16)
    for index in range(2):
        engine.add_request(f"r{index}", [5, 6, 7, 8 + index], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == steps
    for line in lines:
        assert line["cpu_ms"] >= 0 and line["faults"] >= 0 and line["switches"] >= 0 and line["preempted"] >= 0
    assert lines[0]["prefill"] == 8 and lines[-1]["prefill"] == 0
    figures = last_json_line(["benchmarks/step_log.py", str(log), "--slowest", "3"])
    assert sum(kind["steps"] for kind in figures["kinds"].values()) == steps
    slowest = figures["slowest"]
    assert len(slowest) == 3 and slowest[0]["ms"] == max(line["ms"] for line in lines)
    assert all(step["cores"] >= 0 and step["preempted"] >= 0 for step in slowest)


def test_dense_memory_script(tiny_model_dir):
    """A dense engine's memory growth over its weights, beside the runtime's (a 2-layer model
    measured alike), each case in a fresh process."""
    figures = last_json_line(["benchmarks/dense_memory.py", "--model", tiny_model_dir, "--dtype", "float32",
                              "--no-compile"])
    case = figures["cases"]["float32"]
    assert case["weights_bytes"] == case["parameters"] * 4 > 0 and case["pools"] > 0
    assert case["peak_growth"] >= case["resident_growth"] > 0 and case["runtime"] > 0
    assert case["resident_less_runtime"] == case["resident_growth"] - case["runtime"]
    assert case["compiled"] is None and case["compiled_state"] == "off"


def test_llama_cpp_is_built_without_amx_where_the_cpu_has_it(tmp_path):
    """llama.cpp's native build dies with SIGILL in its AMX kernel: on a CPU with AMX the peers'
    build names the vector extensions the CPU has, AMX off; elsewhere it builds native."""
    import subprocess

    def flags(cpu_flags: str) -> list[str]:
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {cpu_flags}\n")
        done = subprocess.run(["bash", str(ROOT / "benchmarks/peers/llama_cpp_isa.sh"), str(cpuinfo)],
                              capture_output=True, text=True, check=True)
        return done.stdout.split()

    assert flags("fpu avx avx2 fma f16c avx512f avx512_vnni") == ["-DGGML_NATIVE=ON"]
    amx = flags("fpu avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AMX_INT8=OFF" in amx and "-DGGML_AMX_TILE=OFF" in amx
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON"} <= set(amx)
    assert "-DGGML_AVX512_VBMI=ON" not in amx  # only what the CPU has
