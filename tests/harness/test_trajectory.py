import json
from dataclasses import fields

import pytest
import torch

from codedojo.engine.types import encode_routed_experts
from codedojo.harness.trajectory import (
    ToolCallRecord,
    Trajectory,
    TrajectoryWriter,
    Turn,
    load,
    read_jsonl,
    write_parquet,
)


def _traj() -> Trajectory:
    t = Trajectory(task="fix it", model="m", tool_schemas=[{"type": "function", "function": {"name": "grep"}}],
                   tool_versions={"grep": "1"})
    t.messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{\"pattern\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "grep", "content": "a.py:1:x"},
    ]
    t.turns.append(Turn(index=0, segment=0, kind="action", message=t.messages[2], prompt_ids=[1, 2, 3],
                        completion_ids=[4, 5], logprobs=[-0.5, -0.25], loss_mask=[0, 0, 0, 1, 1],
                        tool_calls=[ToolCallRecord("c1", "grep", "1", False, False, 0.01, 8)]))
    return t


def test_jsonl_step_log_round_trip(tmp_path):
    t = _traj()
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    w.start(t)
    w.step(t)
    # A crash here leaves a readable, still-running trajectory.
    partial = read_jsonl(tmp_path / "t.jsonl")
    assert partial.status == "running" and len(partial.turns) == 1 and len(partial.messages) == 4
    t.messages.append({"role": "assistant", "content": "done"})
    t.turns.append(Turn(index=1, segment=0, kind="action", message=t.messages[-1], prompt_ids=[1], completion_ids=[9],
                        logprobs=[-1.0], loss_mask=[0, 1]))
    t.status, t.final_message = "finished", "done"
    w.finish(t)
    back = read_jsonl(tmp_path / "t.jsonl")
    back.validate()
    assert back.to_dict() == t.to_dict()


def test_partial_last_line_is_tolerated_but_corruption_is_not(tmp_path):
    t = _traj()
    p = tmp_path / "t.jsonl"
    w = TrajectoryWriter(p)
    w.start(t)
    w.step(t)
    w.close()
    with p.open("a") as fh:
        fh.write('{"type": "turn", "tur')  # killed mid-write
    assert len(read_jsonl(p).turns) == 1
    lines = p.read_text().splitlines()
    lines.insert(1, "garbage")
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_jsonl(p)


def test_parquet_round_trip(tmp_path):
    a, b = _traj(), _traj()
    b.status = "max_turns"
    b.turns[0].cached_tokens = 2  # an MoE policy's turn, its prompt partly from a prefix cache
    b.turns[0].routed_experts = encode_routed_experts(torch.tensor([[[1, 6]], [[0, 3]], [[2, 7]], [[5, 1]]]))
    b.validate()
    write_parquet([a, b], tmp_path / "d.parquet")
    back = load(tmp_path / "d.parquet")
    assert [x.to_dict() for x in back] == [a.to_dict(), b.to_dict()]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "d.parquet")
    turn_type = table.schema.field("turns").type.value_type
    assert turn_type.field("completion_ids").type.value_type == pa.int32()
    # Every field of a turn has a column: none is dropped on the way to a dataset.
    assert {turn_type.field(i).name for i in range(turn_type.num_fields)} == {f.name for f in fields(Turn)}


def test_validate_names_the_problem():
    t = _traj()
    t.turns[0].loss_mask = [1]
    with pytest.raises(ValueError, match="turn 0: loss_mask"):
        t.validate()
    t = _traj()
    t.messages.append({"role": "tool", "tool_call_id": "nope", "content": ""})
    with pytest.raises(ValueError, match=r"messages\[4\].tool_call_id"):
        t.validate()


def test_traj_show_cli(tmp_path):
    from typer.testing import CliRunner

    from codedojo.cli import app

    t = _traj()
    t.status, t.final_message = "finished", "all good"
    p = tmp_path / "t.jsonl"
    w = TrajectoryWriter(p)
    w.start(t)
    w.finish(t)
    r = CliRunner().invoke(app, ["traj", "show", str(p)], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "grep" in r.output and "a.py:1:x" in r.output and "all good" in r.output and "finished" in r.output
    r = CliRunner().invoke(app, ["traj", "show", str(tmp_path / "missing.jsonl")], env={"COLUMNS": "300"})
    assert r.exit_code != 0 and "does not exist" in " ".join(r.output.split())
    out = tmp_path / "all.parquet"
    r = CliRunner().invoke(app, ["traj", "export", str(p), "-o", str(out)])
    assert r.exit_code == 0 and json.loads(json.dumps(load(out)[0].to_dict()))["final_message"] == "all good"
