"""One data-parallel replica: an LLMEngine in a process of its own, driven over two pipes.

The API process (engine/data_parallel.py) sends commands; this loop applies them between steps, steps
the engine while it has work, and sends back what changed. Everything that crosses is a plain tuple of
picklable values (RequestOutput, EngineStats and SamplingParams are dataclasses) — never a function.

    API process -> replica                      replica -> API process
    ("add", call_id, request_id, prompt,        ("ready", ReplicaInfo) | ("failed", kind, message)
            params, arrival_time)               ("reply", call_id, error | None, value)
    ("abort", request_id)                       ("step", outputs, stats, num_added)
    ("trace", call_id, max_steps)               ("error", request_ids, message)  a step failed: these end
    ("shutdown",)

A "step" message follows every pass that changed something, and one a second anyway (a heartbeat):
its stats are what /metrics, /health and the router read, and `num_added` (sequences this replica has
taken in so far, accepted or not) tells the router how many of the requests it sent are already counted
in those stats. The replica exits when told to or when its command pipe closes (the API process died).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

logger = logging.getLogger("pagedserve")

HEARTBEAT_S = 1.0  # a busy replica reports at least this often (the API process's stall detection)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the API process needs of the model to stand in for the engine (tokenizer, limits)."""

    model_path: str
    served_model_name: str
    architecture: str | None
    max_model_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pid: int


def _label_logs(index: int) -> None:
    for handler in logging.getLogger("pagedserve").handlers:
        handler.setFormatter(logging.Formatter(
            f"%(levelname)s %(asctime)s %(name)s [replica {index}]: %(message)s", "%m-%d %H:%M:%S"))


def replica_main(index: int, config, commands: Connection, results: Connection, max_queue_len: int | None) -> None:
    """The replica process's entry point (multiprocessing 'spawn': importable, arguments picklable)."""
    import os

    # Ctrl-C reaches the whole process group: the API process decides when replicas stop (after draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import pagedserve  # noqa: F401  (configures pagedserve's log handler)

    _label_logs(index)
    try:
        from pagedserve.engine.engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as e:  # report why, so the server says it instead of "replica died"
        logger.exception("replica %d failed to start", index)
        results.send(("failed", "ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e)))
        return
    info = ReplicaInfo(
        model_path=engine.model_path, served_model_name=engine.served_model_name,
        architecture=engine.model_config.architecture, max_model_len=engine.max_model_len,
        block_size=config.block_size, vocab_size=engine.model_config.vocab_size,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)), pid=os.getpid(),
    )
    results.send(("ready", info, engine.stats()))
    try:
        _Loop(engine, commands, results, max_queue_len).run()
    except (EOFError, OSError, BrokenPipeError):  # the API process went away: nothing left to serve
        pass
    finally:
        try:
            engine.abort_all()
        except Exception:
            logger.exception("abort at replica exit failed")


class _Loop:
    def __init__(self, engine, commands: Connection, results: Connection, max_queue_len: int | None) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.max_queue_len = max_queue_len
        self.num_added = 0  # sequences taken in (accepted or refused): the router's bookkeeping
        self.outputs: list = []  # abort outputs waiting for the next "step" message
        self.last_stats = None
        self.last_sent = 0.0

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            changed = False
            if self.commands.poll(0 if busy else HEARTBEAT_S):
                while True:
                    if not self._apply(self.commands.recv()):
                        return
                    changed = True
                    if not self.commands.poll(0):
                        break
            if self.engine.has_unfinished_requests():
                try:
                    self.outputs.extend(self.engine.step())
                except Exception as e:  # never let one failure kill the replica; fail what is in flight
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
            self._report(changed)

    def _report(self, changed: bool) -> None:
        stats = self.engine.stats()
        now = time.monotonic()
        if not (changed or self.outputs or stats != self.last_stats or now - self.last_sent >= HEARTBEAT_S):
            return
        outputs, self.outputs = self.outputs, []
        self.results.send(("step", outputs, stats, self.num_added))
        self.last_stats, self.last_sent = stats, now

    def _apply(self, msg: tuple) -> bool:
        """One command; False for shutdown."""
        kind = msg[0]
        if kind == "abort":
            self.outputs.extend(self.engine.abort_request(msg[1]))
        elif kind == "add":
            _, call_id, request_id, prompt, params, arrival_time = msg
            self.num_added += params.n
            self.results.send(("reply", call_id, self._add(request_id, prompt, params, arrival_time), None))
        elif kind == "trace":
            _, call_id, max_steps = msg
            try:
                from pagedserve.engine.trace import engine_trace_data

                self.results.send(("reply", call_id, None, engine_trace_data(self.engine, max_steps)))
            except Exception as e:
                self.results.send(("reply", call_id, RuntimeError(f"trace failed: {e}"), None))
        elif kind == "shutdown":
            return False
        return True

    def _add(self, request_id: str, prompt, params, arrival_time: float) -> BaseException | None:
        from pagedserve.engine.async_engine import QueueFullError

        if self.max_queue_len is not None and self.engine.stats().num_waiting + params.n > self.max_queue_len:
            return QueueFullError(f"the server's queue is full ({self.max_queue_len} sequences waiting on this "
                                  "replica); retry later")
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time)
        except ValueError as e:  # bad input: a 400 naming the field (sent as a plain ValueError)
            return ValueError(str(e))
        except Exception as e:
            return RuntimeError(f"{type(e).__name__}: {e}")
        return None

    def _fail_all(self, error: Exception) -> None:
        try:
            ids = [out.request_id for out in self.engine.abort_all()]
        except Exception:
            logger.exception("abort after an engine error failed")
            ids = None  # the API process fails every request it sent here
        self.outputs.clear()
        self.results.send(("error", ids, f"engine error: {error}"))
