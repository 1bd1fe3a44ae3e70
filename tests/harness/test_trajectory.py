import errno
import json
import os
import resource
import signal
from dataclasses import fields
from itertools import islice

import pytest
import torch

from codedojo.engine.types import decode_routed_experts, encode_routed_experts
from codedojo.harness.trajectory import (
    FORMAT_VERSION,
    ToolCallRecord,
    Trajectory,
    TrajectoryWriter,
    Turn,
    load,
    read_jsonl,
    stored_turn,
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


def _stepped(path):
    """A step log of `_traj()` as a run leaves it after its first step (no end yet)."""
    t = _traj()
    w = TrajectoryWriter(path)
    w.start(t)
    w.step(t)
    w.close()
    return path


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
    assert back.turns == t.turns
    assert back.to_dict() == t.to_dict()


def test_a_lone_surrogate_in_a_message_is_written_and_read_back(tmp_path):
    """Text a server sent with half an emoji in it is kept as it came, not a failed write."""
    t = _traj()
    t.messages.append({"role": "assistant", "content": "smile \ud83d"})
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    w.start(t)
    w.finish(t)
    assert read_jsonl(tmp_path / "t.jsonl").messages[-1]["content"] == "smile \ud83d"
    t.final_message = t.error = t.task = "done \ud83d"
    write_parquet([t], tmp_path / "t.parquet")
    back = load(tmp_path / "t.parquet")[0]
    assert back.messages[-1]["content"] == "smile \ud83d"
    assert back.final_message == back.error == back.task == "done \\ud83d"  # as its escape


def test_partial_last_line_is_tolerated_but_corruption_is_not(tmp_path):
    p = _stepped(tmp_path / "t.jsonl")
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
    a.turns[0].logprobs = [-0.6987289248333944, -1e-9]  # as sampled, to the last bit
    b.status = "max_turns"
    b.turns[0].cached_tokens = 2  # an MoE policy's turn, its prompt partly from a prefix cache
    b.turns[0].routed_experts = encode_routed_experts(torch.tensor([[[1, 6]], [[0, 3]], [[2, 7]], [[5, 1]]]))
    b.validate()
    write_parquet([a, b], tmp_path / "d.parquet")
    back = load(tmp_path / "d.parquet")
    assert [x.to_dict() for x in back] == [a.to_dict(), b.to_dict()]
    assert [x.turns for x in back] == [a.turns, b.turns]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "d.parquet")
    turn_type = table.schema.field("turns").type.value_type
    assert turn_type.field("completion_ids").type.value_type == pa.int32()
    # Every field of a stored turn has a column: none is dropped on the way to a dataset.
    stored = set(stored_turn(a.turns[0], None))
    assert stored == {f.name for f in fields(Turn)} - {"loss_mask"} | {"prompt_shared", "loss_mask_runs"}
    assert {turn_type.field(i).name for i in range(turn_type.num_fields)} == stored


def _episode(turns: int, new: int) -> Trajectory:
    """An agent episode: each prompt is the one before, its completion and `new` tokens of tool
    output; the last turn starts a new context (a self-summary), sharing only the system prompt."""
    t = Trajectory(task="long")
    t.messages = [{"role": "user", "content": "go"}]
    prompt = list(range(50))
    for i in range(turns):
        if i == turns - 1:
            prompt = prompt[:10] + [7] * 30
        completion = [1000 + i] * 20
        t.turns.append(Turn(index=i, segment=0, kind="action", message={"role": "assistant", "content": ""},
                            prompt_ids=list(prompt), completion_ids=completion, logprobs=[-0.25] * 20,
                            loss_mask=[0] * len(prompt) + [1] * 20))
        prompt = prompt + completion + [2000 + i] * new
    return t


def test_a_long_episode_is_stored_in_the_tokens_each_turn_adds(tmp_path):
    t = _episode(turns=30, new=100)
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    w.start(t)
    w.finish(t)
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    stored = [x["turn"] for x in lines if x["type"] == "turn"]
    assert [len(x["prompt_ids"]) for x in stored] == [50] + [100] * 28 + [30]
    assert [x["prompt_shared"] for x in stored[:3]] == [0, 70, 190]
    assert stored[-1]["prompt_shared"] == 10  # a new context shares only its start
    assert stored[0]["loss_mask_runs"] == [50, 20]
    back = read_jsonl(tmp_path / "t.jsonl")
    assert back.turns == t.turns
    write_parquet([t], tmp_path / "d.parquet")
    assert load(tmp_path / "d.parquet")[0].turns == t.turns
    # a turn whose prompt_shared runs past the turn before is refused, naming the line
    lines[3]["turn"]["prompt_shared"] = 10_000
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"bad.jsonl:4: turn 2: prompt_shared 10000 tokens, but "
                                         r"the turn before has 190"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_older_formats_read_and_newer_ones_are_refused(tmp_path):
    t = _traj()
    old = {**t.header(), "format": 2}
    whole = {f.name: getattr(t.turns[0], f.name) for f in fields(Turn)}
    whole["tool_calls"] = [vars(c) for c in t.turns[0].tool_calls]
    p = tmp_path / "old.jsonl"
    p.write_text(json.dumps(old) + "\n" + json.dumps({"type": "turn", "turn": whole}) + "\n")
    assert read_jsonl(p).turns == t.turns  # format 2 kept turns whole
    p.write_text(json.dumps({**t.header(), "format": FORMAT_VERSION + 1}) + "\n")
    with pytest.raises(ValueError, match=f"old.jsonl:1: trajectory format {FORMAT_VERSION + 1} is "
                                         "newer than this codedojo reads"):
        read_jsonl(p)
    with pytest.raises(ValueError, match="turn 0: loss_mask must hold 0/1 only, got 2"):
        stored_turn(Turn(index=0, segment=0, kind="action", message={}, prompt_ids=[1],
                         completion_ids=[2], loss_mask=[0, 2]), None)


def _routed_turn(index: int, fed: int, routed: torch.Tensor | None) -> Turn:
    """A turn of ``fed`` + 1 tokens (the last sampled one never fed) and its routing."""
    return Turn(index=index, segment=0, kind="action", message={"role": "assistant", "content": ""},
                prompt_ids=list(range(fed - 1)), completion_ids=[7, 8], logprobs=[-1.0, -1.0],
                routed_experts=None if routed is None else encode_routed_experts(routed))


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(got, want, strict=True))


def test_turns_keep_the_routing_rows_they_add_and_give_back_whole_rows(tmp_path):
    g = torch.Generator().manual_seed(0)
    r0 = torch.randint(0, 300, (9, 2, 3), generator=g)  # 300 experts: uint16 on the wire
    r1 = torch.cat([r0, torch.randint(0, 300, (6, 2, 3), generator=g)])  # turn 0's rows, then new
    r2 = r1.clone()
    r2[11, 1, 2] = (r2[11, 1, 2] + 1) % 300  # routed apart from row 11 on (another server pass)
    r3 = torch.randint(0, 300, (5, 2, 3), generator=g)  # a new context: nothing in common
    r5 = r3[:4].clone()  # follows a turn without routing: stored whole
    t = _traj()
    t.turns.clear()
    for i, r in enumerate([r0, r1, r2, r3, None, r5]):
        t.add_turn(_routed_turn(i, 6 if r is None else len(r), r))
    assert [u.routed_experts_shared for u in t.turns] == [0, 9, 11, 0, 0, 0]
    stored = [0 if u.routed_experts is None else len(decode_routed_experts(u.routed_experts))
              for u in t.turns]
    assert stored == [9, 6, 4, 5, 0, 4]  # 28 rows kept of the 59 the turns fed
    whole = list(t.iter_routed_experts())
    assert _same(whole, [r0, r1, r2, r3, None, r5])
    t.validate()
    # Both stores keep the shared form, and it reads back whole.
    write_parquet([t], tmp_path / "d.parquet")
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    w.start(t)
    w.finish(t)
    for back in (load(tmp_path / "d.parquet")[0], read_jsonl(tmp_path / "t.jsonl")):
        assert back.to_dict() == t.to_dict()
        assert _same(list(back.iter_routed_experts()), whole)
        # A trajectory read back goes on sharing with its last turn's rows.
        back.add_turn(_routed_turn(6, 6, torch.cat([r5, r5[:2]])))
        assert back.turns[-1].routed_experts_shared == 4
        assert torch.equal(list(back.iter_routed_experts())[-1], torch.cat([r5, r5[:2]]))
    # Shared rows the turn before does not have are named.
    t.turns[3].routed_experts_shared = 1
    t.turns[3].routed_experts = encode_routed_experts(r3[1:])
    t.turns[5].routed_experts_shared = 1
    t.turns[5].routed_experts = encode_routed_experts(r5[1:])
    t.turns[3].validate()
    with pytest.raises(ValueError, match="turn 5: routed_experts_shared 1 rows, but the turn before has 0"):
        t.validate()
    with pytest.raises(ValueError, match="turn 5: routed_experts_shared 1 rows, but the turn before has 0"):
        list(t.iter_routed_experts())
    assert torch.equal(list(islice(t.iter_routed_experts(), 4))[3], torch.cat([r2[:1], r3[1:]]))
    with pytest.raises(ValueError, match="add_turn takes a turn's whole routing"):
        t.add_turn(t.turns[5])
    bad = _routed_turn(0, 4, r0[:4])
    bad.routed_experts_shared = 1
    with pytest.raises(ValueError, match="turn 0: routed_experts has 4 rows after 1 shared for the 4"):
        bad.validate()
    bad.routed_experts = None
    with pytest.raises(ValueError, match="turn 0: routed_experts_shared without routed_experts"):
        bad.validate()


def test_validate_names_the_problem():
    t = _traj()
    t.turns[0].loss_mask = [1, 0, 0, 1, 1]  # a prompt token trained (with logprob 0: certain)
    with pytest.raises(ValueError, match="turn 0: loss_mask trains a prompt token"):
        t.validate()
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

    def show(t: Trajectory, p) -> str:
        w = TrajectoryWriter(p)
        w.start(t)
        w.finish(t)
        r = CliRunner().invoke(app, ["traj", "show", str(p)], env={"COLUMNS": "160"})
        assert r.exit_code == 0, r.output
        return r.output

    t = _traj()
    t.status, t.final_message = "finished", "all good"
    t.turns[0].cached_tokens = 2
    p = tmp_path / "t.jsonl"
    out = show(t, p)
    assert "grep" in out and "a.py:1:x" in out and "all good" in out and "finished" in out
    assert "1 sequence(s), 5 tokens (5 turn by turn)" in out
    # The turns table: prompt 3 tokens, 2 of them from the prefix cache, 2 sampled, 2 trained.
    lines = out.splitlines()
    head = next(line for line in lines if "┃ kind" in line).split("┃")[1:-1]
    row = next(line for line in lines if "│ action" in line).split("│")[1:-1]
    cols = {h.strip(): c.strip() for h, c in zip(head, row, strict=True)}
    assert {k: cols[k] for k in ("prompt", "cached", "completion", "trained")} == {
        "prompt": "3", "cached": "2", "completion": "2", "trained": "2"}
    # text that reads as markup is shown as it is
    t.turns[0].tool_calls[0].name, t.error = "[/b]", "cannot read [/workspace/x]"
    t.final_message = "see [/workspace/y]"
    out = show(t, tmp_path / "marked.jsonl")
    assert "cannot read [/workspace/x]" in out and "[/b]" in out and "see [/workspace/y]" in out
    r = CliRunner().invoke(app, ["traj", "show", str(tmp_path / "missing.jsonl")], env={"COLUMNS": "300"})
    assert r.exit_code != 0 and "does not exist" in " ".join(r.output.split())
    exported = tmp_path / "all.parquet"
    r = CliRunner().invoke(app, ["traj", "export", str(p), "-o", str(exported)])
    assert r.exit_code == 0
    assert json.loads(json.dumps(load(exported)[0].to_dict()))["final_message"] == "all good"


def test_traj_cli_names_a_file_it_cannot_read_or_write(tmp_path):
    """A directory, a missing file, one that is not a step log, a place the output cannot go or
    a negative width: one line naming it, exit status 2, no traceback."""
    from typer.testing import CliRunner

    from codedojo.cli import app

    good = _stepped(tmp_path / "t.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "end", "status": "finished"}\n')
    out = str(tmp_path / "all.parquet")
    for args, said in [
        (["show", str(tmp_path)], f"{tmp_path}: Is a directory"),
        (["show", str(good), "--max-chars", "-5"], "--max-chars"),
        (["export", str(tmp_path / "missing.jsonl"), "-o", out], "missing.jsonl does not exist"),
        (["export", str(good), str(bad), "-o", out],
         f"{bad}:1: the first record must be the header"),
        (["export", str(good), str(tmp_path), "-o", out], f"{tmp_path}: Is a directory"),
        (["export", str(good), "-o", str(good / "all.parquet")], "--out"),
    ]:
        r = CliRunner().invoke(app, ["traj", *args], env={"COLUMNS": "300"})
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (args, r.output)
        assert said in r.output and "Traceback" not in r.output, (args, r.output)
    assert not (tmp_path / "all.parquet").exists()


def test_export_refuses_to_write_over_one_of_its_inputs(tmp_path):
    """`dojo traj export` with --out one of the inputs (by its own name or through a link): one
    line naming it, exit status 2, the step log as it was."""
    from typer.testing import CliRunner

    from codedojo.cli import app

    good = _stepped(tmp_path / "t.jsonl")
    other = _stepped(tmp_path / "u.jsonl")
    before = good.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(good)
    for out in (good, tmp_path / "link.jsonl"):
        r = CliRunner().invoke(app, ["traj", "export", str(other), str(good), "-o", str(out)],
                               env={"COLUMNS": "300"})
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert "--out" in r.output and f"is the input {good}" in r.output, r.output
        assert good.read_bytes() == before


def test_a_line_cut_inside_a_character_is_a_partial_last_line(tmp_path):
    p = _stepped(tmp_path / "t.jsonl")
    line = ('{"type": "end", "status": "finished", "final_message": "Voilà"}').encode()
    with p.open("ab") as fh:
        fh.write(line[:line.index("à".encode()) + 1])  # killed between the two bytes of "à"
    back = read_jsonl(p)
    assert back.status == "running" and len(back.turns) == 1


def test_a_step_tried_again_after_a_failed_write_stores_no_turn_twice(tmp_path, monkeypatch):
    t = _traj()
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    w.start(t)
    real = w._line
    failed = []

    def flaky(obj):
        if obj.get("type") == "messages" and not failed:
            failed.append(1)
            raise OSError("disk hiccup")
        real(obj)

    monkeypatch.setattr(w, "_line", flaky)
    with pytest.raises(OSError):
        w.step(t)
    w.finish(t)
    back = read_jsonl(tmp_path / "t.jsonl")
    assert len(back.turns) == 1 and back.messages == t.messages


def _fill_disk_mid_line(path, monkeypatch):
    """The file may grow 100 bytes more: the next line is cut part-way, as on a full disk."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 100, limits[1]))
    return lambda: (resource.setrlimit(resource.RLIMIT_FSIZE, limits),
                    signal.signal(signal.SIGXFSZ, old_handler))


def _fail_first_sync(path, monkeypatch):
    real, calls = os.fsync, []

    def flaky(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "fsync failed")
        real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    return lambda: None


@pytest.mark.parametrize("fault", [_fill_disk_mid_line, _fail_first_sync],
                         ids=["disk full mid-line", "sync fails"])
def test_a_step_whose_write_fails_leaves_no_part_of_its_line(tmp_path, monkeypatch, fault):
    p = tmp_path / "t.jsonl"
    t = _traj()
    w = TrajectoryWriter(p)
    w.start(t)
    t.messages.append({"role": "assistant", "content": "x" * 5000})
    t.turns.append(Turn(index=1, segment=0, kind="action", message=t.messages[-1],
                        prompt_ids=[1, 2, 3], completion_ids=[9], logprobs=[-1.0],
                        loss_mask=[0, 0, 0, 1]))
    restore = fault(p, monkeypatch)
    try:
        with pytest.raises(OSError):
            w.step(t)
    finally:
        restore()
    w.finish(t)  # (as Agent.run does after a failed step)
    back = read_jsonl(p)
    assert [u.index for u in back.turns] == [0, 1] and back.messages == t.messages


@pytest.mark.parametrize("line, why", [
    ('{"type": "turn"}', "a 'turn' record that is not one"),
    ('{"type": "turn", "turn": {"index": 1}}', "a 'turn' record that is not one"),
    ('{"type": "messages", "messages": []}', "a 'messages' record that is not one"),
    ('{"type": "messages", "start": 5.0, "messages": [], "segments": []}',
     "messages start 5.0: a count >= 0 expected"),
    ("[1, 2]", "a JSON object expected, got list"),
])
def test_a_malformed_record_is_named_by_its_line(tmp_path, line, why):
    p = _stepped(tmp_path / "t.jsonl")
    with p.open("a") as fh:
        fh.write(line + "\n" + json.dumps({"type": "end", "status": "finished"}) + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:4: {why}".replace("[", r"\[")):
        read_jsonl(p)


def test_a_logprob_that_is_no_log_of_a_probability_is_refused():
    for bad in (float("nan"), float("inf"), 0.7):
        t = _traj()
        t.turns[0].logprobs = [-0.5, bad]
        with pytest.raises(ValueError, match="turn 0: a logprob is a log of a probability"):
            t.validate()
    t.turns[0].logprobs = [-0.5, 1e-7]  # above 0 by rounding only
    t.validate()


def test_a_failed_export_leaves_the_parquet_file_it_would_replace(tmp_path, monkeypatch):
    """`dojo traj export -o existing.parquet` stopped mid-write keeps the old dataset."""
    import pyarrow.parquet as pq

    old = _traj()
    write_parquet([old], tmp_path / "d.parquet")
    real = pq.write_table

    def cut_short(table, where, **kw):  # the disk fills up, or the process is stopped
        real(table, where, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", cut_short)
    with pytest.raises(OSError, match="No space"):
        write_parquet([_traj(), _traj()], tmp_path / "d.parquet")
    assert [t.to_dict() for t in load(tmp_path / "d.parquet")] == [old.to_dict()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


def test_a_new_step_log_takes_the_name_once_its_header_is_written(tmp_path):
    """An episode run again to the same path replaces the old log with a readable one, never
    an empty one, and a writer that never starts leaves neither the old log nor a stray file."""
    path = tmp_path / "t.jsonl"
    finished = _traj()
    finished.status = "finished"
    w = TrajectoryWriter(path)
    w.start(finished)
    w.finish(finished)
    w = TrajectoryWriter(path)
    assert read_jsonl(path).status == "finished"  # nothing of the new episode yet
    w.close()
    assert read_jsonl(path).status == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    w = TrajectoryWriter(path)
    w.start(_traj())
    assert read_jsonl(path).status == "running"
    w.close()
    assert path.stat().st_mode & 0o777 == 0o644
