"""The engine core in a process of its own (started by engine/runtime/process_client.py), as vLLM v1 runs
its EngineCore: a busy loop that takes requests, steps and sends each step's token outputs back,
while the serving process tokenizes, detokenizes, checks stop strings and streams. Its threads
and the GIL are its own: an HTTP server's per-token Python never delays a step here.

The channel is one socket (a `multiprocessing.connection.Connection`: pickled messages).

    frontend -> core:  ("add", request_id, token_ids, params, cache_salt, num_shared_prefix_tokens)
                       ("abort", request_id)  ("finish", sample_id)  ("block_map", token)  ("shutdown",)
    core -> frontend:  ("ready", info, stats, compiled_pending) or ("failed", why), once
                       ("step", [TokenOutput, ...], stats, compiled_pending) after every step
                       ("stats", stats, compiled_pending) when its state changed between steps
                       ("block_map", token, BlockMapState | error text)

The core ends when the frontend closes the socket (whatever way it went) or says shutdown.

    python -m engine.runtime.core_process FD    # only as engine/runtime/process_client.py starts it
"""
from __future__ import annotations

import gc
import logging
import signal
import sys
from multiprocessing.connection import Connection

from engine.outputs import TokenOutput
from engine.worker import cpu_binding

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0  # an idle core looks this often for a compiled step that became ready


def run(connection: Connection) -> None:
    _, options = connection.recv()
    try:  # before torch loads the OpenMP runtime, which reads the binding once
        _, threads, binding = cpu_binding.bind_compute_threads(options.get("device"), options.pop("num_threads", None))
    except ValueError as error:
        connection.send(("failed", str(error)))
        return
    import torch

    from engine.runtime.engine_core import EngineCore

    if threads:
        torch.set_num_threads(threads)
    log.info("%s", binding)

    try:
        core = EngineCore(**options)
    except Exception as error:
        log.exception("the engine core could not start")
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    core.load_compiled_steps_if_built()
    # Everything loaded so far (torch, the model, its tables) lives as long as the process: frozen
    # out of the collector's reach, so that an oldest-generation collection scans only what the
    # requests made since. Scanning the whole heap took 60-150 ms, inside whichever step it fell
    # on: one such step over a streaming chat's 200-ms bar fails every chat running then.
    gc.collect()
    gc.freeze()
    pending = core.compiled_pending()
    connection.send(("ready", core.info(), core.stats(), pending))
    while True:
        busy = core.has_unfinished()
        if not busy and not connection.poll(IDLE_POLL_S):
            if pending != core.compiled_pending():
                pending = core.compiled_pending()
                connection.send(("stats", core.stats(), pending))
            continue
        changed = False
        while connection.poll():  # everything that has arrived, then one step
            message = connection.recv()
            if message[0] == "shutdown":
                return
            outputs = _handle(core, connection, message)
            if outputs:
                connection.send(("step", outputs, core.stats(), core.compiled_pending()))
            changed = True
        if core.has_unfinished():
            try:
                outputs = core.step()
            except Exception as error:  # a bug outside the forward: fail what is open, keep serving
                log.exception("engine step failed; ending every open request")
                outputs = _fail_all(core, f"{type(error).__name__}: {error}")
            pending = core.compiled_pending()
            connection.send(("step", outputs, core.stats(), pending))
        elif changed:  # aborts emptied it: no step will say so
            core.scheduler.refresh_stats()
            connection.send(("stats", core.stats(), core.compiled_pending()))


def _handle(core, connection: Connection, message: tuple) -> list[TokenOutput]:
    kind = message[0]
    if kind == "add":
        _, request_id, token_ids, params, cache_salt, num_shared = message
        try:
            core.add_request(request_id, token_ids, params, cache_salt=cache_salt,
                             num_shared_prefix_tokens=num_shared)
        except Exception as error:  # the frontend checked it; should the core still refuse, say why
            return [TokenOutput(request_id, index, (), "error", error=f"{type(error).__name__}: {error}")
                    for index in range(params.n)]
    elif kind == "abort":
        core.abort_request(message[1])
    elif kind == "finish":
        if message[1] in core.scheduler.requests:
            core.finish_request(message[1])
    elif kind == "block_map":
        try:
            answer = core.block_map_state()
        except Exception as error:  # the caller gets the error; the core goes on
            answer = f"{type(error).__name__}: {error}"
        connection.send(("block_map", message[1], answer))
    return []


def _fail_all(core, reason: str) -> list[TokenOutput]:
    """Every open request ends with an error output per sample (the frontend drops those of
    samples that had ended already); their blocks return."""
    groups = {r.parent_id or r.request_id: r.sampling_params.n for r in core.scheduler.requests.values()}
    outputs = []
    for group, n in groups.items():
        try:
            core.abort_request(group)
        except Exception:  # the state that failed the step may fail this too; end the request anyway
            log.exception("could not abort %s", group)
        outputs += [TokenOutput(group, index, (), "error", error=reason) for index in range(n)]
    core.scheduler.refresh_stats()
    return outputs


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle; it closes us
    logging.basicConfig(level=logging.INFO, format="engine core: %(levelname)s %(name)s: %(message)s")
    connection = Connection(int(sys.argv[1]))
    try:
        run(connection)
    except (EOFError, OSError):  # the frontend is gone: nothing is left to serve
        pass
    finally:
        connection.close()


if __name__ == "__main__":
    main()
