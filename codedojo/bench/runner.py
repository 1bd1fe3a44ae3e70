"""The runner: agents on tasks in parallel sandboxes, graded on fresh copies.

For every (task, sample): create the agent's sandbox (no hidden tests, no gold patch, no
history), let the agent work in it, collect what changed under /workspace, destroy it; then
apply those changes to a fresh grading sandbox and run the hidden tests there. An exception
from the sandbox, the harness or the model endpoint is an infra failure, counted apart from an
unresolved task. pass@k uses the unbiased estimator over the samples of each task, an infra
failure among them taken as a sample that did not pass (so the figure is never flattered by one).
The agent's episode ends at the task's `timeouts.agent_s`; what it changed by then is graded.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from codedojo.bench.patching import apply_patch
from codedojo.bench.task import Task
from codedojo.bench.workspace import WORKSPACE, TaskImages, collect_changes, grade_changes
from codedojo.paths import write_atomic
from codedojo.sandbox.base import Sandbox, SandboxError

Status = Literal["resolved", "unresolved", "infra_failure"]


@dataclass
class AgentResult:
    """What an agent reports about one episode (the runner measures time itself)."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the engine took from its prefix cache
    completion_tokens: int = 0
    status: str = "finished"
    trajectory: str | None = None  # path of the saved trajectory, when there is one


class BenchAgent(Protocol):
    name: str

    def solve(self, task: Task, sandbox: Sandbox, out_dir: Path) -> AgentResult: ...


class OracleAgent:
    """Applies the gold patch through the sandbox's file API: must resolve every valid task."""

    name = "oracle"

    def solve(self, task: Task, sandbox: Sandbox, out_dir: Path) -> AgentResult:
        def read(rel: str) -> str | None:
            try:
                return sandbox.read_file(f"{WORKSPACE}/{rel}").decode("utf-8")
            except SandboxError:
                return None

        for rel, content in apply_patch(task.patch, read).items():
            if content is None:
                sandbox.remove(f"{WORKSPACE}/{rel}")
            else:
                sandbox.write_file(f"{WORKSPACE}/{rel}", content)
        return AgentResult(turns=1)


class NullAgent:
    """Changes nothing: the baseline every task must fail (a sanity check of the suite)."""

    name = "null"

    def solve(self, task: Task, sandbox: Sandbox, out_dir: Path) -> AgentResult:
        return AgentResult(turns=0)


def task_prompt(task: Task, max_chars: int | None = None) -> str:
    """The agent's first message. `max_chars` shortens a long statement (a big log) for a model
    with a small context: the head and the tail stay, the middle is marked as cut."""
    statement = task.problem_statement
    if max_chars and len(statement) > max_chars:
        head, tail = statement[: max_chars * 2 // 3], statement[-(max_chars // 3):]
        cut = statement.count("\n") - head.count("\n") - tail.count("\n")
        statement = f"{head}\n[... {cut} lines cut to fit the context ...]\n{tail}"
    return (
        f"{statement}\n\n"
        f"The project's source is in {WORKSPACE}. Make your change there; hidden tests will check it."
    )


class HarnessAgent:
    """A policy through the harness's agent loop, with the harness's tools on the sandbox."""

    def __init__(self, policy: Any, loop_config: Any = None, tool_config: Any = None, name: str | None = None,
                 max_prompt_chars: int | None = None):
        from codedojo.harness.loop import LoopConfig
        from codedojo.harness.toolset import EnvToolConfig

        self.policy = policy
        self.max_prompt_chars = max_prompt_chars
        self.loop_config = loop_config or LoopConfig()
        self.tool_config = tool_config or EnvToolConfig(
            tools=[t for t in EnvToolConfig().tools if t not in ("codebase_search", "web_fetch")]
        )
        self.name = name or getattr(policy, "name", "model")

    @property
    def settings(self) -> dict[str, Any]:
        """What makes its episodes besides its name: a stopped run goes on only with the same."""
        return {"model": getattr(self.policy, "name", None),
                "endpoint": getattr(self.policy, "base_url", None),  # (None: in this process)
                "text_format": getattr(self.policy, "text_format", None),
                "sampling": getattr(self.policy, "sampling", None),
                "loop": self.loop_config.model_dump(mode="json"),
                "tools": self.tool_config.model_dump(mode="json"),
                "max_prompt_chars": self.max_prompt_chars}

    def solve(self, task: Task, sandbox: Sandbox, out_dir: Path) -> AgentResult:
        from codedojo.harness.loop import Agent
        from codedojo.harness.tools.base import ToolContext
        from codedojo.harness.toolset import ToolRegistry, ToolSession

        loop = self.loop_config
        if loop.max_seconds is None or loop.max_seconds > task.timeouts.agent_s:
            loop = loop.model_copy(update={"max_seconds": task.timeouts.agent_s})
        session = ToolSession(ToolRegistry().resolve(self.tool_config),
                              ToolContext(sandbox=sandbox))
        try:
            traj_path = out_dir / f"{task.instance_id}.traj.jsonl"
            traj = Agent(self.policy, loop).run(
                task_prompt(task, self.max_prompt_chars), session, out=traj_path, env=f"dojobench/{task.instance_id}",
                metadata={"instance_id": task.instance_id, "category": task.category},
            )
        finally:
            session.close()
        actions = [t for t in traj.turns if t.kind == "action"]
        if traj.status == "error":
            raise RuntimeError(f"agent episode failed: {traj.error}")
        return AgentResult(
            turns=len(actions),
            prompt_tokens=sum(t.prompt_tokens or 0 for t in traj.turns),
            cached_tokens=sum(t.cached_tokens or 0 for t in traj.turns),
            completion_tokens=sum(t.completion_tokens or 0 for t in traj.turns),
            status=traj.status,
            trajectory=str(traj_path),
        )


@dataclass
class TaskResult:
    instance_id: str
    category: str
    sample: int
    status: Status
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    agent_status: str = ""
    setup_s: float = 0.0
    agent_s: float = 0.0
    grade_s: float = 0.0
    error: str = ""
    changed_files: list[str] = field(default_factory=list)
    ended_s: float = 0.0  # the run's wall time, all its starts, when this episode ended

    @property
    def total_s(self) -> float:
        return self.setup_s + self.agent_s + self.grade_s


def run_one(images: TaskImages, agent: BenchAgent, task: Task, sample: int, out_dir: Path) -> TaskResult:
    res = TaskResult(task.instance_id, task.category, sample, "infra_failure",
                     f2p_total=len(task.FAIL_TO_PASS), p2p_total=len(task.PASS_TO_PASS))
    sb: Sandbox | None = None
    try:
        t0 = time.perf_counter()
        sb = images.agent_sandbox(task)
        res.setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ar = _solve_in_time(agent, task, sb, out_dir)
        res.agent_s = time.perf_counter() - t0
        res.turns, res.agent_status = ar.turns, ar.status
        res.prompt_tokens, res.completion_tokens = ar.prompt_tokens, ar.completion_tokens
        res.cached_tokens = ar.cached_tokens
        changes = collect_changes(sb)
        res.changed_files = sorted(changes)
        sb.destroy()
        sb = None
        t0 = time.perf_counter()
        ok, report = grade_changes(images, task, changes)
        if report.infra_error:  # the environment's fault, or the agent's change's?
            if not changes:
                raise RuntimeError(f"grading: {report.infra_error}")
            unchanged = images.baseline(task)
            if unchanged.infra_error:  # not the change's: the same on the task as it came
                raise RuntimeError(f"grading, with and without the agent's changes: "
                                   f"{unchanged.infra_error}")
        res.grade_s = time.perf_counter() - t0
        res.f2p_passed = len(set(task.FAIL_TO_PASS) & report.passed(strict=True))
        res.p2p_passed = len(set(task.PASS_TO_PASS) & report.passed())
        res.status = "resolved" if ok else "unresolved"
    except Exception as e:
        res.status = "infra_failure"
        res.error = f"{type(e).__name__}: {e}"[:2000]
        _keep_error(out_dir / f"{task.instance_id}.s{sample}.error.txt", traceback.format_exc())
    finally:
        if sb is not None:
            try:
                sb.destroy()
            except Exception:
                pass
    return res


def _keep_error(path: Path, text: str) -> None:
    """An episode's traceback, written beside its files (the folder made where the agent made
    none); a write that fails is let go: the episode's result holds its error still."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# How long calls the agent began before its episode ended may take to end, once its commands
# are killed, before the runner gives up grading a sandbox that may still change
DRAIN_S = 60.0


def _solve_in_time(agent: BenchAgent, task: Task, sb: Sandbox, out_dir: Path) -> AgentResult:
    """The agent's episode, held to the task's ``timeouts.agent_s`` (and a tenth more, for an
    agent that keeps the limit itself and ends a step past it). The agent works through an
    `_EpisodeView` of ``sb``, closed when its episode ends (it returned, or its time is up):
    later calls through it fail, and its commands, those it left running too, are killed: what
    is graded is what it changed by then."""
    done: dict[str, Any] = {}
    gate = _Gate()
    view = _EpisodeView(sb, gate)

    def solve() -> None:
        try:
            done["result"] = agent.solve(task, cast(Sandbox, view), out_dir)
        except BaseException as e:  # raised again in the runner's thread
            done["error"] = e

    worker = threading.Thread(target=solve, name=f"agent-{task.instance_id}", daemon=True)
    worker.start()
    worker.join(task.timeouts.agent_s * 1.1 + 1.0)
    gate.close()
    past_limit = worker.is_alive()  # (an answer it gives from now on is too late)
    with contextlib.suppress(SandboxError):  # what its commands still do (in the background
        sb.exec(["kill", "-KILL", "-1"], timeout=10)  # too) stops here, before the collect
    if not gate.wait_idle(DRAIN_S):
        raise RuntimeError(f"the agent's sandbox calls went on {DRAIN_S:g} s past the end of "
                           "its episode: what it changed cannot be collected")
    if past_limit:
        return AgentResult(status="max_seconds")
    if "error" in done:
        raise done["error"]
    return done["result"]


class _Gate:
    """Lets calls through until closed, and counts those going on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._calls = 0

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise SandboxError("the episode has ended (the agent returned or its time was "
                                   "up): its sandbox takes no more calls")
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Whether the calls going on ended within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._calls == 0, timeout)


class _EpisodeView:
    """An agent's sandbox (or a shell it opened there) as the agent holds it: each method
    call goes through ``gate``, refused once the gate is closed."""

    def __init__(self, target: Any, gate: _Gate) -> None:
        self._target, self._gate = target, gate

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._gate.open():
                out = attr(*args, **kwargs)
            return _EpisodeView(out, self._gate) if name == "shell" else out

        return call


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class RunResult:
    name: str
    agent: str
    suite: str
    samples: int
    parallel: int
    wall_s: float
    results: list[TaskResult]

    def failed_entirely(self) -> str | None:
        """Why the run measured nothing, when every episode of it was an infra failure (the
        agent could not start, its endpoint did not answer); None when any episode ran."""
        if not self.results or any(r.status != "infra_failure" for r in self.results):
            return None
        first = next((r.error.strip() for r in self.results if r.error.strip()),
                     "no error recorded")
        return (f"every one of the run's {len(self.results)} episode(s) was an infra failure "
                f"(the first: {first.splitlines()[0][:200]})")

    def counts(self) -> dict[str, int]:
        out = {"resolved": 0, "unresolved": 0, "infra_failure": 0}
        for r in self.results:
            out[r.status] += 1
        return out

    def pass_at(self, k: int) -> float:
        """Mean pass@k over tasks; infra failures count as samples that did not pass."""
        by_task: dict[str, list[TaskResult]] = {}
        for r in self.results:
            by_task.setdefault(r.instance_id, []).append(r)
        if not by_task:
            return 0.0
        return sum(pass_at_k(len(rs), sum(r.status == "resolved" for r in rs), k) for rs in by_task.values()) / len(by_task)

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        d = json.loads(text)
        results = [TaskResult(**r) for r in d["results"]]
        return cls(d["name"], d["agent"], d["suite"], d["samples"], d["parallel"], d["wall_s"], results)

    def to_json(self) -> dict[str, Any]:
        ks = [k for k in (1, 2, 5, 10) if k <= self.samples]
        return {
            "name": self.name, "agent": self.agent, "suite": self.suite, "samples": self.samples,
            "parallel": self.parallel, "wall_s": round(self.wall_s, 3), "counts": self.counts(),
            "pass_at_k": {str(k): round(self.pass_at(k), 4) for k in ks},
            "results": [asdict(r) for r in self.results],
        }


def run_agent(
    images: TaskImages,
    agent: BenchAgent,
    tasks: Sequence[Task],
    *,
    name: str,
    suite: str = "",
    samples: int = 1,
    parallel: int = 1,
    out_dir: str | Path = "runs",
    progress: Callable[[TaskResult], None] | None = None,
    replace: bool = False,
) -> RunResult:
    """Every task `samples` times, `parallel` sandboxes at a time; results under runs/<name>/.

    Each episode's result is appended to ``results.partial.jsonl`` as it ends, so a run stopped
    part-way (interrupted, out of memory) and started again with the same agent (its
    ``settings`` too), suite and samples goes on with the episodes it had not finished;
    ``results.json`` replaces the file once all have. The tasks it had results for must be
    among those selected, as they were (by content hash); more may be added. Anything else is
    refused, and the log left as it is, unless ``replace``: then the run begins again, its
    results dropped. A finished run of the name is refused unless ``replace`` too (`dojo demo`
    runs again over its own, whatever its options were). A task whose image cannot be built is
    an infra failure of its own. An agent's files go under ``episodes/s<sample>/``."""
    out = Path(out_dir) / name
    partial = out / "results.partial.jsonl"
    if (out / "results.json").exists() and not partial.exists() and not replace:
        raise RunNameTaken(f"{out} holds a finished run (results.json): choose another name, "
                           "or move that run away")
    (out / "episodes").mkdir(parents=True, exist_ok=True)
    header = {"agent": agent.name, "settings": getattr(agent, "settings", {}), "suite": suite,
              "samples": samples, "tasks": {t.instance_id: t.content_hash() for t in tasks}}
    try:
        results = _finished(partial, header)
    except StoppedRunMismatch:
        if not replace:
            raise
        results = []  # (the log begun again below drops them)
    done = {(r.instance_id, r.sample) for r in results}
    # the log as it will go on, whole before it replaces the old (a crash keeps one or other)
    write_atomic(partial, "".join(json.dumps(x) + "\n"
                                  for x in [header, *(asdict(r) for r in results)]))
    # the clock goes on from where a stopped start left it
    t0 = time.perf_counter() - max((r.ended_s for r in results), default=0.0)

    def record(r: TaskResult) -> None:
        r.ended_s = time.perf_counter() - t0
        _record(partial, results, progress, r)

    jobs = []
    for t in tasks:  # build images up front so parallel workers do not race to build them
        todo = [(t, s) for s in range(samples) if (t.instance_id, s) not in done]
        if not todo:
            continue
        try:
            images.warm(t)
        except Exception as e:
            for _, s in todo:
                record(TaskResult(t.instance_id, t.category, s, "infra_failure",
                                  error=f"task image: {type(e).__name__}: {e}"[:2000]))
            continue
        jobs += todo
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for r in pool.map(lambda job: run_one(images, agent, job[0], job[1],
                                              out / "episodes" / f"s{job[1]}"), jobs):
            record(r)
    run = RunResult(name, agent.name, suite, samples, parallel, time.perf_counter() - t0, results)
    (out / "results.json").write_text(json.dumps(run.to_json(), indent=1))
    partial.unlink()
    return run


class RunNameTaken(ValueError):
    """A run's name holds a run this one cannot be written over."""


class StoppedRunMismatch(RunNameTaken):
    """A run's name holds a stopped run that this one cannot go on with."""


def _finished(partial: Path, header: dict[str, Any]) -> list[TaskResult]:
    """The episodes a stopped run logged, where it is this run's (see `run_agent`)."""
    lines = partial.read_text().splitlines() if partial.exists() else []
    if not lines:
        return []
    try:
        was = json.loads(lines[0])
    except ValueError:
        was = {}
    out = []
    for line in lines[1:]:
        try:
            out.append(TaskResult(**json.loads(line)))
        except (ValueError, TypeError):  # a line the stop cut short
            break
    if not out:  # no result to keep: the log is begun again
        return []
    why = [f"{k} {was.get(k)!r}, not {header[k]!r}" for k in ("agent", "suite", "samples")
           if was.get(k) != header[k]]
    why += [f"settings {key} {a!r}, not {b!r}"
            for key, a, b in _differences(was.get("settings") or {}, header["settings"])]
    tasks, had = header["tasks"], was.get("tasks") or {}
    gone = sorted({r.instance_id for r in out if r.instance_id not in tasks})
    changed = sorted({r.instance_id for r in out if r.instance_id in tasks
                      and had.get(r.instance_id) != tasks[r.instance_id]})
    if gone:
        why.append(f"results for tasks not selected now: {', '.join(gone[:3])}")
    if changed:
        why.append(f"tasks whose content changed since: {', '.join(changed[:3])}")
    if why:
        raise StoppedRunMismatch(f"{partial.parent}: a stopped run is there, of another kind ("
                         f"{'; '.join(why)}); start it again as it was, or give this run "
                         f"another name (its log {partial.name} is left as it is)")
    return out


def _differences(was: Any, now: Any, at: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, was, now) for each leaf of two nested dicts that differs (a table one of
    them lacks is an empty one)."""
    if was is None and isinstance(now, dict) or now is None and isinstance(was, dict):
        was, now = was or {}, now or {}
    if not (isinstance(was, dict) and isinstance(now, dict)):
        return [] if was == now else [(at or "(all)", was, now)]
    return [d for k in sorted({*was, *now}, key=str)
            for d in _differences(was.get(k), now.get(k), f"{at}.{k}" if at else str(k))]


def _record(partial: Path, results: list[TaskResult],
            progress: Callable[[TaskResult], None] | None, r: TaskResult) -> None:
    results.append(r)
    with partial.open("a") as log:
        log.write(json.dumps(asdict(r)) + "\n")
    if progress:
        progress(r)
