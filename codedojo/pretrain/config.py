"""The job config of `dojo pretrain`: one TOML file describes the corpus, the model and an ordered
list of stages (bulk, long-context, SFT, MTP self-distillation), all run by the same loop."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from codedojo.configfile import PlainName, field_errors, read_toml
from codedojo.data.corpus import CorpusConfig
from codedojo.data.readers import SourceConfig
from codedojo.model.config import RopeScaling


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: str = Field("smollm2-135m-instruct", description="What `load_model` accepts (a known "
                      "name, a GGUF file or an HF/safetensors directory), or `tiny` for a random "
                      "tiny model (tests).")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="bf16 runs forward/backward (and "
                                           "self-generation) under autocast; master weights and "
                                           "optimizer stay fp32.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train. auto: "
                                                   "this process's GPU (LOCAL_RANK under "
                                                   "torchrun) when CUDA is available, else the "
                                                   "CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute each block's "
                                           "activations in backward (memory for compute).")
    compile: bool = Field(False, description="torch.compile each block for the calls without "
                          "a KV cache (training, teacher, eval): fused elementwise work; the first "
                          "steps of each shape pay the compile.")
    n_mtp: int = Field(0, ge=0, description="MTP modules to attach (0: none).")
    mtp_draft_vocab: int = Field(0, ge=0, description="Draft (and distil) MTP over the N most "
                                 "frequent tokens of the training data (0: the full vocab).")
    mtp_taps: list[int] = Field(default_factory=list, description="Layers (0-based, increasing) "
                                "whose states every MTP module reads beside the previous "
                                "depth's (EAGLE-3's fused features; `codedojo.model.mtp`).")
    mtp_blocks: int = Field(1, ge=1, description="Transformer blocks stacked in each MTP "
                            "module (the first starts as the main model's last, the others as "
                            "the identity).")
    tiny_overrides: dict[str, object] = Field(default_factory=dict,
                                              description="ModelConfig fields for base = tiny.")


class MixEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: Literal["code", "long", "sft", "self"] = Field(
        description="code: training code shards; long: directory-level concatenations; sft: "
        "rendered chats and tool trajectories; self: the model's own greedy continuations of "
        "code (the stage's `self_gen`).")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, description="Only documents at least this long.")


class SelfGenConfig(BaseModel):
    """The model's own continuations of windows of code, generated when the stage starts
    (`codedojo.pretrain.selfgen`): MTP modules distilled on them learn the text they draft."""

    model_config = ConfigDict(extra="forbid")

    prompts: int = Field(256, ge=1)
    prompt_len: int = Field(64, ge=1, description="Tokens of code each continuation follows.")
    new_tokens: int = Field(96, ge=1, description="Greedy tokens generated per prompt.")
    batch: int = Field(64, ge=1, description="Prompts generated together. Decoding is bound by "
                       "reading the weights at small batches: SmolLM2-135M on 2 CPU cores "
                       "decodes 253 tokens/s at 16 rows, 614 at 64.")
    doc_start_frac: float = Field(0.5, ge=0, le=1, description="Share of prompts taken at the "
                                  "start of a file (the rest at random offsets).")
    sources: list[SourceConfig] = Field(default_factory=list, description="Code to draw prompts "
                                        "from besides the training code, all windows alike: the "
                                        "code the drafts will serve, or more distinct windows "
                                        "than the corpus holds. Filtered and deduplicated as the "
                                        "corpus is; a file equal to a corpus document (training "
                                        "or held out) is left out.")
    prompt_loss: bool = Field(True, description="Whether the modules also learn where the next "
                              "token is the prompt's (code as written). False: only where it is "
                              "the model's own, the text they draft when serving; the prompt "
                              "is then context only.")

    @model_serializer(mode="wrap")
    def _as_before(self, handler: Any) -> dict[str, Any]:
        # Fields at the defaults they were added with dump as before they existed: the caches
        # keyed by these settings (the continuations, the packed rows) stay valid.
        d: dict[str, Any] = handler(self)
        if not self.sources:
            d.pop("sources", None)
        if self.prompt_loss:
            d.pop("prompt_loss", None)
        return d


Beta = Annotated[float, Field(ge=0, lt=1)]


def decay_steps(steps: int, decay_frac: float) -> int:
    """The steps of a stage's final decay (at least one when it has a decay)."""
    return max(1, round(steps * decay_frac)) if decay_frac > 0 else 0


class StageConfig(BaseModel):
    """One stage of the loop. A fresh optimizer and schedule per stage (as the CPT recipe does:
    each stage has its own warmup-stable-decay)."""

    model_config = ConfigDict(extra="forbid")

    name: PlainName  # a directory: ckpt/<stage>
    seq_len: int = Field(ge=8)
    batch_size: int = Field(4, ge=1, description="Rows per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    steps: int = Field(ge=1, description="Optimizer steps.")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="LR at the end of decay / peak.")
    warmup_steps: int = Field(0, ge=0)
    decay_frac: float = Field(0.2, ge=0, le=1, description="Share of steps in the final decay.")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    mix: list[MixEntry] = Field(description="Weighted data for this stage.")
    rope_scaling: RopeScaling | None = Field(
        None, description="Applied to the model at the start of the stage and kept afterwards "
        "(long-context). YaRN's `original_max_seq_len` is the model's length before its first "
        "YaRN extension: that length when left out, refused when another.")
    probe: bool = Field(False, description="Run the passkey retrieval probe before and after.")
    mtp: Literal["off", "distill", "joint"] = Field("off", description="distill: train only the "
                                                    "MTP modules toward the main head (frozen "
                                                    "model); joint: main loss + mtp_weight * MTP "
                                                    "distillation loss.")
    mtp_weight: float = Field(0.3, ge=0)
    mtp_detach: bool = Field(False, description="Each MTP module reads the previous one's "
                             "states without sending it gradients: every module learns its "
                             "own depth only.")
    mtp_greedy: float = Field(0.0, ge=0, le=1, description="Share of the MTP distillation "
                              "loss given to the cross-entropy of the main head's greedy "
                              "token (what a greedy draft must equal) instead of the KL.")
    mtp_taps_lr_mult: float = Field(10.0, gt=0, description="The learning rate of the MTP "
                                    "modules' projections of the tapped layers (`model."
                                    "mtp_taps`), as a multiple of the stage's: they start at "
                                    "zero and must reach the residual stream's scale.")
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0: end).")
    dtype: Literal["fp32", "bf16"] | None = Field(None, description="This stage's precision, "
                                                  "as the model's `dtype` says it (default: "
                                                  "that one); under FSDP the shards are "
                                                  "gathered in the model's.")
    self_gen: SelfGenConfig | None = Field(None, description="Generate the `self` data of this "
                                           "stage's mix.")

    @model_validator(mode="after")
    def _check(self) -> StageConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(f"stage {self.name!r}: warmup_steps > steps")
        decay = decay_steps(self.steps, self.decay_frac)
        if self.warmup_steps > self.steps - decay:
            raise ValueError(f"stage {self.name!r}: warmup_steps ({self.warmup_steps}) runs into "
                             f"the decay, which starts at step {self.steps - decay} of "
                             f"{self.steps} (decay_frac {self.decay_frac})")
        if not self.mix:
            raise ValueError(f"stage {self.name!r}: mix must list at least one entry")
        for knob in ("mtp_detach", "mtp_greedy"):
            if getattr(self, knob) and self.mtp == "off":
                raise ValueError(f"stage {self.name!r}: {knob} is for a stage that trains the "
                                 "MTP modules (mtp = \"distill\" or \"joint\")")
        if any(e.data == "self" for e in self.mix) != (self.self_gen is not None):
            raise ValueError(f"stage {self.name!r}: a `self` mix entry and `self_gen` go "
                             "together")
        g = self.self_gen
        if g is not None and g.prompt_len + g.new_tokens > self.seq_len + 1:
            raise ValueError(f"stage {self.name!r}: a continuation (self_gen.prompt_len + "
                             f"new_tokens = {g.prompt_len + g.new_tokens}) is packed whole, in "
                             f"a row of seq_len + 1 = {self.seq_len + 1} tokens")
        return self


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(256, ge=8)
    batch_size: int = Field(4, ge=1)
    batches: int = Field(4, ge=1, description="Held-out batches per evaluation (fixed set).")
    every: int = Field(0, ge=0, description="Also evaluate every this many steps of a stage, "
                       "logged with the step in metrics.jsonl (0: after each stage only).")
    continuations: int = Field(0, ge=0, description="Windows of the held-out code (seq_len // 2 "
                               "tokens) the model continues greedily by as many tokens as "
                               "each stage starts (or resumes) once MTP modules are trained: "
                               "the drafts' agreement on them (mtp_agree) is what greedy "
                               "speculative decoding meets. 0: on the code as written only "
                               "(mtp_agree_text).")
    probe_len: int = Field(512, ge=32, description="Tokens of code around the passkey.")
    probe_trials: int = Field(4, ge=1)


class PretrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: PlainName = Field(description="Run name: outputs go to <out_dir>/<name>/.")
    out_dir: str = "runs"
    seed: int = 0
    model: ModelSpec = Field(default_factory=ModelSpec)
    corpus: CorpusConfig
    long_docs_chars: tuple[int, int] = Field((4000, 40000), description="min/max characters of a "
                                             "directory-level long document.")
    sft_examples: int = Field(200, ge=0, description="Code SFT examples built from the corpus.")
    sft_jsonl: str | None = Field(None, description="Extra SFT conversations (messages/tools).")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    stages: list[StageConfig] = Field(min_length=1)
    export_hf: bool = Field(True, description="Export the final model as HF safetensors.")

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: names must be unique, got {names}")
        if "base" in names:
            raise ValueError(f"stages[{names.index('base')}].name: \"base\" is taken: report.json "
                             "keeps the base model's figures under it; name the stage otherwise")
        if any(s.mtp != "off" for s in self.stages) and self.model.n_mtp == 0:
            raise ValueError("model.n_mtp must be > 0 when a stage trains MTP modules")
        taps = self.model.mtp_taps
        if any(t < 0 for t in taps) or taps != sorted(set(taps)):
            raise ValueError(f"model.mtp_taps: {taps} must be increasing layer indexes >= 0")
        lo, hi = self.long_docs_chars
        if not 1 <= lo <= hi:
            raise ValueError(f"long_docs_chars: ({lo}, {hi}) must be (min, max) with "
                             "1 <= min <= max")
        for i, st in enumerate(self.stages):
            if (any(e.data == "sft" for e in st.mix) and not self.sft_examples
                    and not self.sft_jsonl):
                raise ValueError(f"stages[{i}] ({st.name}): an `sft` mix entry, but no SFT "
                                 "data (sft_examples is 0 and no sft_jsonl)")
            if st.mtp != "off" and self.model.n_mtp >= st.seq_len:
                raise ValueError(f"stages[{i}] ({st.name}).seq_len {st.seq_len}: the stage "
                                 f"trains MTP modules, and model.n_mtp {self.model.n_mtp} "
                                 "must be below it (module k trains on the row's positions "
                                 "but its last k)")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> PretrainConfig:
    """TOML -> config, with ``overrides`` (`apply_overrides`) set over it; errors name the file
    and the field path."""
    path = Path(path)
    raw = apply_overrides(read_toml(path), overrides)
    try:
        return PretrainConfig.model_validate(raw)
    except ValidationError as e:
        where = f"{path}" + (f" with --set {' '.join(overrides)}" if overrides else "")
        raise ValueError(f"{where}: {field_errors(e.errors())}") from e


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of a config's TOML tables with ``KEY=VALUE`` settings applied in order. KEY is a
    dotted path; an item of a list (``stages``, ``corpus.sources``) is named by its ``name``
    (dots and all: ``stages.v1.5.lr``) or its index: ``stages.mtp_self.lr=3e-3``,
    ``model.n_mtp=3``, ``corpus.sources.0.max_files=50``. VALUE is read as a TOML value
    (``3e-3``, ``true``, ``[1, 2]``, ``"a b"``), or else taken as a bare string
    (``out_dir=runs/exp``). A key the config does not know is refused when the
    result is validated; an item that is not there, here."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, KEY a dotted path such as "
                             "stages.mtp_self.lr")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node: Any = out
        i = 0  # parts[:i] name the node
        while True:
            if isinstance(node, list):
                n = _name_parts(node, parts[i:])
                at = _list_index(node, ".".join(parts[i:i + n]), ".".join(parts[:i]), item)
            else:
                n, at = 1, parts[i]
            i += n
            if i == len(parts):
                node[at] = value
                break
            node = node[at] if isinstance(node, list) else node.setdefault(at, {})
            if not isinstance(node, dict | list):
                raise ValueError(f"--set {item!r}: {'.'.join(parts[:i])} is a value, not a "
                                 "table")
    return out


def _name_parts(items: list[Any], parts: list[str]) -> int:
    """How many of the leading ``parts`` name an item of a list: a name may hold dots
    (``stages.v1.5.lr``), the longest one that names an item; else one, a name or an index."""
    names = {x.get("name") for x in items if isinstance(x, dict)}
    return next((n for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in names), 1)


def _list_index(items: list[Any], part: str, path: str, item: str) -> int:
    """The index of a list item named by its ``name`` or its position."""
    names = [x.get("name") if isinstance(x, dict) else None for x in items]
    if part in names:
        return names.index(part)
    if part.isdigit() and int(part) < len(items):
        return int(part)
    known = ", ".join(str(n) for n in names if n is not None)
    raise ValueError(f"--set {item!r}: {path} has no item {part!r} ({len(items)} items"
                     + (f": {known})" if known else ")"))
