"""`dojo pretrain CONFIG`: run the staged continued-pretraining job a TOML file describes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer


def register(app: typer.Typer) -> None:
    @app.command("pretrain")
    def pretrain(
        config: Annotated[Path, typer.Argument(help="TOML job config, e.g. "
                                                "configs/cpt-smollm2.toml")],
        out_dir: Annotated[str | None, typer.Option(help="Override the config's out_dir.")] = None,
        overrides: Annotated[list[str] | None, typer.Option(
            "--set", help="KEY=VALUE over the config, repeatable: a dotted path, list items by "
            "name or index (stages.mtp_self.lr=3e-3, model.n_mtp=3), a TOML value or else a "
            "string.")] = None,
        branch_from: Annotated[Path | None, typer.Option(
            "--from", help="Start a new run (give it another --out-dir or name) from this run "
            "directory's data and its leading finished stages whose settings this config keeps; "
            "the rest run.")] = None,
    ) -> None:
        """Continued pretraining in stages (bulk, MTP distillation, long-context, SFT); reports
        held-out code loss per stage under runs/<name>/report.json, and the config it ran with
        (overrides applied) as runs/<name>/config.json. Under `torchrun
        --nproc_per_node N` it trains data-parallel with FSDP2 (NCCL on GPUs, gloo on CPUs)."""
        import json

        from pydantic import ValidationError
        from rich.console import Console

        from codedojo.configfile import field_errors
        from codedojo.pretrain.branch import BranchError
        from codedojo.pretrain.config import load_config
        from codedojo.pretrain.parallel import exit_distributed, is_main
        from codedojo.pretrain.trainer import run
        from codedojo.progress import progress_every

        console = Console()
        try:
            cfg = load_config(config, overrides or ())
        except ValueError as e:
            _fail(console, "config error", str(e))
        if out_dir is not None:
            cfg = cfg.model_copy(update={"out_dir": out_dir})
        try:
            progress_every()  # a bad $CODEDOJO_PROGRESS_EVERY is named now, not after the data
            report = run(cfg, console=console, branch_from=branch_from)
        except BranchError as e:  # from the branch, or a run's own settings changed
            _fail(console, "--from" if branch_from is not None else "resume", str(e))
        except ValidationError as e:  # a model the settings make (model.tiny_overrides)
            _fail(console, "error", f"{e.title}: {field_errors(e.errors())}")
        except (ValueError, OSError) as e:  # a base model, a file or a setting it cannot use
            # (or a fault of the trainer's that is one: its traceback goes to the run's folder)
            _fail(console, "error", str(e) + _traceback_kept(cfg.run_dir))
        if is_main():
            keys = ("eval_loss", "mtp_agree", "mtp_agree_text", "probe")
            console.print_json(json.dumps({k: report[k] for k in keys if k in report}))
        exit_distributed()  # under torchrun; after a failure torchrun stops the others


def _traceback_kept(run_dir: Path) -> str:
    """Write the exception being handled's traceback to ``run_dir``/error.txt, where the run
    has a folder; what to add to its one-line message."""
    import traceback

    if not run_dir.is_dir():
        return ""
    path = run_dir / "error.txt"
    try:
        path.write_text(traceback.format_exc())
    except OSError:
        return ""
    return f" (traceback: {path})"


def _fail(console: Any, what: str, why: str) -> NoReturn:
    """Say what is wrong on one line (brackets in ``why`` are text, not markup); exit 2."""
    from rich.markup import escape

    console.print(f"[red]{what}[/]: {escape(why)}", soft_wrap=True)
    raise typer.Exit(2)
