"""The agent loop end to end on a real repository in a real sandbox."""

from __future__ import annotations

import time

import pytest

from codedojo.harness.loop import SUMMARY_PREFIX, Agent, LoopConfig
from codedojo.harness.policy import PolicyOutput, ScriptedPolicy, _for_api, _for_openai
from codedojo.harness.rpc import ToolServer, serve_in_thread
from codedojo.harness.trajectory import read_jsonl, read_parquet, write_parquet
from codedojo.model.toolcalls import ToolCall, ToolCallError
from codedojo.reward import RewardContext, compute_reward
from codedojo.reward.changes import collect_changes
from codedojo.reward.outcome import grade
from tests.harness.conftest import F2P, P2P

TASK = "low_stock(items, threshold) should include items whose quantity equals the threshold. Fix it."


def fixing_script() -> ScriptedPolicy:
    def check_grep(messages):
        # React to what the tools said, as a model would.
        assert "stock.py-19-    return [i.name for i in items if i.qty < threshold]" in messages[-1]["content"]
        return [("read_file", {"target_file": "inventory/stock.py", "offset": 17, "limit": 3})]

    return ScriptedPolicy([
        [("todo_write", {"merge": False, "todos": [
            {"id": "find", "content": "find low_stock", "status": "in_progress"},
            {"id": "fix", "content": "fix the comparison"},
            {"id": "test", "content": "run the tests"}]})],
        [("grep", {"pattern": "def low_stock", "-A": 2})],
        check_grep,
        [("search_replace", {"file_path": "inventory/stock.py", "old_string": "i.qty < threshold",
                             "new_string": "i.qty <= threshold"}),
         ("todo_write", {"merge": True, "todos": [{"id": "find", "status": "completed"},
                                                  {"id": "fix", "status": "completed"}]})],
        [("run_terminal_cmd", {"command": "python3 -m pytest -q -p no:cacheprovider tests"})],
        [("read_lints", {"paths": ["inventory/stock.py"]}),
         ("todo_write", {"merge": True, "todos": [{"id": "test", "status": "completed"}]})],
        "Fixed low_stock: the comparison is now `<=`, so items at the threshold are included. All tests pass.",
    ])


def test_scripted_policy_fixes_a_bug_through_rpc(sandbox, tmp_path):
    server = ToolServer(sandbox=sandbox)
    running = serve_in_thread(server)
    client = running.client()
    try:
        before = grade(sandbox, F2P, P2P)
        assert not all(before.fail_to_pass.values()) and all(before.pass_to_pass.values())

        ep = client.open_episode()
        out = tmp_path / "run" / "traj.jsonl"
        traj = Agent(fixing_script(), LoopConfig(max_turns=20)).run(TASK, ep, out=out, metadata={"task": "inv-1"})
        assert traj.status == "finished", traj.error
        assert traj.final_message.startswith("Fixed low_stock")
        traj.validate()
        assert len(traj.turns) == 7 and traj.tool_call_names().count("todo_write") == 3
        test_output = next(m["content"] for m in traj.messages if m.get("role") == "tool" and "passed" in str(m["content"]))
        assert "3 passed" in test_output
        assert all(not c.is_error for t in traj.turns for c in t.tool_calls)
        assert traj.tool_state["todos"][-1]["status"] == "completed"

        # The outcome reward sees the tests pass; the diff holds exactly the fix.
        report = grade(sandbox, F2P, P2P)
        assert all(report.fail_to_pass.values()) and all(report.pass_to_pass.values())
        changes = collect_changes(sandbox)
        assert [c.path for c in changes] == ["/workspace/inventory/stock.py"]
        assert "i.qty < threshold" in changes[0].before and "i.qty <= threshold" in changes[0].after
        r = compute_reward(RewardContext(traj, report, changes))
        assert r.components["outcome"] == 1.0
        assert r.components["unfinished_todos"] == 0.0
        assert r.components["lint_delta"] == 0.0 and r.components["comment_reasoning"] == 0.0
        assert 0.0 < r.components["length_penalty"] and r.total < 1.0

        # The step log reads back to the same trajectory.
        assert read_jsonl(out).to_dict() == traj.to_dict()
    finally:
        client.close()
        running.stop()
        server.close()


def test_limits_end_the_episode(session):
    loop_forever = ScriptedPolicy([[("run_terminal_cmd", {"command": "true"})]] * 50)
    traj = Agent(loop_forever, LoopConfig(max_turns=3)).run("spin", session)
    assert traj.status == "max_turns" and len(traj.turns) == 3

    class Wordy:
        name = "wordy"

        def generate(self, messages, tools, max_tokens, time_left=None):
            return PolicyOutput(content="", calls=ScriptedPolicy([[("run_terminal_cmd", {"command": "true"})]])
                                .generate(messages, tools, max_tokens).calls, completion_tokens=max_tokens)

    traj = Agent(Wordy(), LoopConfig(max_tokens=1000, max_tokens_per_turn=400)).run("spin", session)
    assert traj.status == "max_tokens" and [t.completion_tokens for t in traj.turns] == [400, 400, 200]

    class Slow(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            time.sleep(0.3)
            return super().generate(messages, tools, max_tokens)

    slow = Slow([[("run_terminal_cmd", {"command": "true"})]] * 50)
    traj = Agent(slow, LoopConfig(max_seconds=0.5)).run("spin", session)
    assert traj.status == "max_seconds" and 1 <= len(traj.turns) <= 2
    # a turn's calls after the limit are answered, not run
    sleepy = ScriptedPolicy([[("run_terminal_cmd", {"command": "sleep 0.4; echo ran"})] * 3])
    traj = Agent(sleepy, LoopConfig(max_seconds=0.5)).run("spin", session)
    answers = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert traj.status == "max_seconds" and len(answers) == 3
    assert "ran" in answers[0] and answers[2] == "Error: not run: the episode's time limit was reached"


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 30 * 24 * 3600.0, 0.0])
def test_an_episode_time_limit_the_tools_cannot_take_is_refused(seconds):
    with pytest.raises(ValueError, match="max_seconds"):
        LoopConfig(max_seconds=seconds)


def test_a_call_id_the_model_reuses_gets_one_of_its_own(session):
    """Ids come from the model's JSON: two calls of one turn named alike, and one of an earlier
    turn named again, each get an id their tool message alone answers."""
    class Reuser:
        name = "reuser"
        n = 0

        def generate(self, messages, tools, max_tokens, time_left=None):
            self.n += 1
            if self.n > 2:
                return PolicyOutput(content="done")
            call = ToolCall("c1", "run_terminal_cmd", {"command": f"echo {self.n}"})
            return PolicyOutput(content="", calls=[call, call] if self.n == 1 else [call])

    traj = Agent(Reuser()).run("t", session)
    assert traj.status == "finished"
    traj.validate()
    ids = [c["id"] for m in traj.messages if m["role"] == "assistant"
           for c in m.get("tool_calls") or []]
    answers = [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"]
    assert len(ids) == len(set(ids)) == 3 and answers == ids and ids[0] == "c1"


def test_a_reply_cut_by_the_token_limit_is_no_answer(session):
    class Cut:
        name = "cut"

        def generate(self, messages, tools, max_tokens, time_left=None):
            return PolicyOutput(content="Let me now open the file and", finish_reason="length",
                                completion_tokens=max_tokens)

    traj = Agent(Cut()).run("t", session)
    assert traj.status == "max_tokens" and traj.final_message is None and len(traj.turns) == 1


def test_a_call_gets_no_more_than_the_time_the_episode_has_left(session):
    """A command started just before the episode's limit stops at the limit, not at its
    tool's own (60 s here)."""
    sleepy = ScriptedPolicy([[("run_terminal_cmd", {"command": "sleep 20; echo ran"})], "done"])
    t0 = time.perf_counter()
    traj = Agent(sleepy, LoopConfig(max_seconds=1.0)).run("spin", session)
    took = time.perf_counter() - t0
    (answer,) = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert traj.status == "max_seconds" and took < 10, took
    assert "timed out after 1s" in answer


def test_malformed_calls_get_tool_errors_and_the_episode_goes_on(session):
    class Sloppy:
        name = "sloppy"
        n = 0

        def generate(self, messages, tools, max_tokens, time_left=None):
            self.n += 1
            if self.n == 1:
                good = ToolCall("call_good", "write", {"file_path": "x.txt", "contents": "x"})
                return PolicyOutput(content="let me look", calls=[good], errors=[
                    ToolCallError("call_bad", "unclosed <tool_call> block: invalid JSON (Expecting value)",
                                  '<tool_call>{"name": "read_file", "arguments": {', "read_file")])
            return PolicyOutput(content="giving up")

    traj = Agent(Sloppy()).run("t", session)
    assert traj.status == "finished"
    traj.validate()
    assistant = traj.messages[2]
    # The text as the model wrote it; no OpenAI tool_calls, the ids answered are listed aside.
    assert assistant["content"].startswith("let me look\n<tool_call>{") and "tool_calls" not in assistant
    assert [c["id"] for c in assistant["invalid_tool_calls"]] == ["call_bad", "call_good"]
    bad, good = traj.messages[3], traj.messages[4]
    assert bad["tool_call_id"] == "call_bad" and bad["content"].startswith("Error: unclosed <tool_call>")
    assert good["tool_call_id"] == "call_good" and "not run" in good["content"]
    assert all(c.is_error for c in traj.turns[0].tool_calls)
    # Sent to an OpenAI-compatible API, the answers to the unrun calls are one user message: a
    # tool message must answer an entry of the assistant's tool_calls, and these have none.
    sent = _for_openai(traj.messages)
    assert [m["role"] for m in sent[2:]] == ["assistant", "user", "assistant"]
    first, second = sent[3]["content"].split("\n\n[your call to write] ")
    assert first == f"[your call to read_file] {bad['content']}"
    assert second.startswith("Error: not run") and set(sent[3]) == {"role", "content"}
    assert "invalid_tool_calls" not in sent[2]
    # to a chat template (the engine's own), they stay tool messages, as SFT renders them
    assert [m["role"] for m in _for_api(traj.messages)[2:]] == [
        "assistant", "tool", "tool", "assistant"]
    assert not any(c.path.endswith("x.txt") for c in session.ctx.sandbox.changes())  # nothing ran


def test_policy_failure_is_terminal(session, tmp_path):
    class Broken:
        name = "broken"

        def generate(self, messages, tools, max_tokens, time_left=None):
            raise ConnectionError("endpoint down")

    traj = Agent(Broken()).run("t", session, out=tmp_path / "t.jsonl")
    assert traj.status == "error" and "endpoint down" in traj.error
    assert read_jsonl(tmp_path / "t.jsonl").status == "error"
    # no turn at all: it still checks, converts and exports with the rest of a batch
    assert traj.turns == []
    traj.validate()
    assert traj.to_dict()["turns"] == []
    write_parquet([traj], tmp_path / "t.parquet")
    assert [t.status for t in read_parquet(tmp_path / "t.parquet")] == ["error"]


def test_self_summary_continues_in_a_fresh_context_as_one_trajectory(session, tmp_path):
    summaries = []

    class Summarising(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            if not tools:  # the loop asks for a summary without offering tools
                summaries.append(messages[-1]["content"])
                return PolicyOutput(content="I read README.md and stock.py; next: run the tests.", completion_tokens=12)
            return super().generate(messages, tools, max_tokens)

    big_reads = [[("run_terminal_cmd", {"command": "seq 1 400"})]] * 4
    policy = Summarising([*big_reads, [("run_terminal_cmd", {"command": "echo after-summary"})], "done"])
    cfg = LoopConfig(context_window=2000, summary_threshold=0.6, max_tokens_per_turn=200, max_turns=20)
    traj = Agent(policy, cfg).run("count things", session, out=tmp_path / "s.jsonl")
    assert traj.status == "finished"
    assert len(summaries) >= 1 and len(traj.segments) == len(summaries) + 1
    traj.validate()
    kinds = [t.kind for t in traj.turns]
    assert kinds.count("summary") == len(summaries)
    # Every later context restarts from system + task + the summary.
    for seg in range(1, len(traj.segments)):
        ctx = traj.context(seg)
        assert [m["role"] for m in ctx[:3]] == ["system", "user", "user"]
        assert ctx[1]["content"] == "count things" and ctx[2]["content"].startswith(SUMMARY_PREFIX)
    assert "echo after-summary" not in str(traj.context(0))
    assert read_jsonl(tmp_path / "s.jsonl").segments == traj.segments


def test_a_summary_running_at_the_episodes_limit_ends_the_episode(session):
    class SlowToSummarise(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            if not tools:  # the summary: a model that writes on past the limit
                if time_left is not None:
                    assert 0 < time_left <= 8
                    time.sleep(time_left)
                return PolicyOutput(content="I read", completion_ids=[5, 6], logprobs=[-1.0, -2.0],
                                    prompt_ids=[1, 2], finish_reason="cancelled")
            return super().generate(messages, tools, max_tokens)

    policy = SlowToSummarise([[("run_terminal_cmd", {"command": "seq 1 400"})]] * 4 + ["done"])
    cfg = LoopConfig(context_window=2000, summary_threshold=0.6, max_tokens_per_turn=200,
                     max_seconds=8)
    t0 = time.perf_counter()
    traj = Agent(policy, cfg).run("count things", session)
    assert traj.status == "max_seconds" and time.perf_counter() - t0 < 20
    last = traj.turns[-1]
    assert last.kind == "summary" and last.finish_reason == "cancelled"
    assert last.completion_ids == [5, 6] and traj.segments == [0]
    assert traj.messages[-1] == {"role": "assistant", "content": "I read"}
    traj.validate()
    # cancelled otherwise (a server stopping): an error, and nothing after it
    policy.calls = 0
    traj = Agent(policy, cfg.model_copy(update={"max_seconds": None})).run("count things", session)
    assert traj.status == "error"
    assert traj.error == "the model call was cancelled before it finished"
    assert traj.turns[-1].kind == "summary" and traj.segments == [0]


@pytest.mark.parametrize("max_summaries", [0])
def test_summaries_can_be_turned_off(session, max_summaries):
    policy = ScriptedPolicy([[("run_terminal_cmd", {"command": "seq 1 400"})]] * 3 + ["done"])
    cfg = LoopConfig(context_window=4000, summary_threshold=0.2, max_summaries=max_summaries)
    traj = Agent(policy, cfg).run("t", session)
    assert traj.status == "finished" and traj.segments == [0]
    # past the window itself, with no summary to make room: the episode ends there
    cfg = LoopConfig(context_window=1000, summary_threshold=0.5, max_summaries=max_summaries)
    policy.calls = 0
    traj = Agent(policy, cfg).run("t", session)
    assert traj.status == "max_context" and traj.segments == [0]


def test_collect_changes_reads_each_before_side_from_the_image(session, sandbox):
    session.call("search_replace", {"file_path": "inventory/stock.py", "old_string": "i.qty < threshold",
                                    "new_string": "i.qty <= threshold"})
    session.call("run_terminal_cmd", {"command": "sed -i 's/Stock keeping/Inventory/' README.md"})
    session.call("write", {"file_path": "inventory/extra.py", "contents": "X = 1\n"})
    session.call("delete_file", {"target_file": "pyproject.toml"})
    changes = {c.path: c for c in collect_changes(sandbox)}
    assert set(changes) == {"/workspace/inventory/stock.py", "/workspace/README.md",
                            "/workspace/inventory/extra.py", "/workspace/pyproject.toml"}
    assert "i.qty < threshold" in changes["/workspace/inventory/stock.py"].before
    # Changed by a shell command, which the tools never saw: the image has it.
    readme = changes["/workspace/README.md"]
    assert "Stock keeping" in readme.before and "Inventory helpers" in readme.after
    assert changes["/workspace/inventory/extra.py"].before is None
    assert changes["/workspace/pyproject.toml"].after is None and "[tool.ruff]" in changes["/workspace/pyproject.toml"].before


def test_a_long_task_is_not_summarised_again_before_any_action(session):
    """A task long enough that the fresh context (system, task, summary) is still over the
    threshold: after a summary the model acts before the next one, instead of the loop spending
    every summary back to back on summaries of summaries."""

    class Summarising(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            if not tools:
                return PolicyOutput(content="Read the task; next: run the tests.", completion_tokens=9)
            return super().generate(messages, tools, max_tokens)

    steps = [[("run_terminal_cmd", {"command": f"echo step {i}"})] for i in range(4)]
    # (the tool schemas in every prompt: about 1,700 tokens, the task's 1,300 beside them)
    cfg = LoopConfig(context_window=4000, summary_threshold=0.6, max_tokens_per_turn=200,
                     max_turns=20)
    traj = Agent(Summarising([*steps, "done"]), cfg).run("x" * 5200, session)
    kinds = [t.kind for t in traj.turns]
    assert traj.status == "finished" and "summary" in kinds
    assert "summary, summary" not in ", ".join(kinds)


def test_a_summary_is_asked_for_within_the_window_after_a_huge_output(session):
    """One tool output past the whole window: the summary call gets the context with that
    output cut in the middle, to fit the window with the turn's budget; the trajectory keeps
    the output whole."""
    seen: list[int] = []

    class Summarising(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            if not tools:
                seen.append(sum(len(str(m.get("content") or "")) for m in messages) // 4)
                return PolicyOutput(content="Printed a lot; next: done.", completion_tokens=9)
            return super().generate(messages, tools, max_tokens)

    big = [("run_terminal_cmd", {"command": "head -c 60000 /dev/zero | tr '\\0' x"})]
    cfg = LoopConfig(context_window=4000, max_tokens_per_turn=500, max_turns=5)
    traj = Agent(Summarising([big, "done"]), cfg).run("print a lot", session)
    assert traj.status == "finished" and [t.kind for t in traj.turns].count("summary") == 1
    assert seen and seen[0] <= 4000 - 500
    output = next(m["content"] for m in traj.messages if m.get("role") == "tool")
    assert output.count("x") >= 19_000  # (the tool's own 20,000-character cap, not the cut)


def test_the_first_reply_asked_for_leaves_room_for_the_tool_schemas_in_the_prompt(session):
    """The template writes the tool schemas into every prompt: a first prompt that fits the
    window with them asks for no more tokens than are left (a server refuses a prompt and
    max_tokens past its window, and the episode ended with no turn)."""
    import json

    window = 8192
    asked: list[tuple[int, int]] = []

    class Counting(ScriptedPolicy):  # four characters a token, as the loop estimates
        def generate(self, messages, tools, max_tokens, time_left=None):
            prompt = (len(json.dumps(messages)) + len(json.dumps(tools)) + 3) // 4
            asked.append((prompt, max_tokens))
            return PolicyOutput(content="done", prompt_tokens=prompt, completion_tokens=1)

    task = "Fix the bug described below.\n" + "x" * 21_000
    traj = Agent(Counting([]), LoopConfig(context_window=window)).run(task, session)
    assert traj.status == "finished"
    ((prompt, max_tokens),) = asked
    assert prompt + max_tokens <= window * 1.01 and prompt + 2048 > window


def test_a_reply_runs_at_most_max_calls_per_turn_and_the_rest_are_answered(session):
    """A degenerate reply that repeats a call is not run thousands of times: each call past
    the limit gets an answer saying so (every call id is answered, as the API requires)."""
    calls = [("run_terminal_cmd", {"command": "echo ran >> log.txt"})] * 5
    cfg = LoopConfig(max_turns=2, max_calls_per_turn=3)
    traj = Agent(ScriptedPolicy([calls, "done"]), cfg).run("t", session)
    assert traj.status == "finished"
    answers = [m["content"] for m in traj.messages if m.get("role") == "tool"]
    assert len(answers) == 5
    assert answers[3:] == ["Error: not run: a reply runs at most 3 tool calls"] * 2
    assert session.call("read_file", {"target_file": "log.txt"}).content.count("ran") == 3


def test_a_step_log_that_cannot_be_started_leaves_no_file(tmp_path):
    """Metadata that is not JSON is named, and nothing is written; a header that fails to be
    written (a tool schema that is not JSON) leaves no file behind either."""
    from pathlib import Path

    class NoTools:
        schemas: list = []
        versions: dict = {}

        def state(self):
            return {}

    with pytest.raises(ValueError, match="metadata.repo: not JSON"):
        Agent(ScriptedPolicy(["done"])).run("task", NoTools(), out=tmp_path / "t.jsonl",
                                            metadata={"repo": Path("/x")})
    assert list(tmp_path.iterdir()) == []
    odd = NoTools()
    odd.schemas = [{"type": "function", "function": {"name": "x", "parameters": {1j}}}]
    with pytest.raises(TypeError, match="not JSON serializable"):
        Agent(ScriptedPolicy(["done"])).run("task", odd, out=tmp_path / "t.jsonl")
    assert list(tmp_path.iterdir()) == []
