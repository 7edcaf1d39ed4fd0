"""Load a Megatron rank's shard straight from an HF checkpoint's safetensors files: no rank holds the whole model.

`load_hf_checkpoint(model, path, config)` fills this rank's Megatron model (its TP shard, PP stage and EP share of
the routed experts, from `parallel_state`) from the HF-layout directory `path` (`config.json` + safetensors,
sharded with an index or not). Each tensor is read with `safe_open(...).get_slice`: a TP rank reads its own rows
or columns of a split tensor (its KV groups of q, k and v), a PP stage only its own layers, an EP rank only its
experts; a slice is cast as it is copied into its parameter, one tensor at a time, so the extra memory is one
tensor's share in the file's dtype. The mapping is `gyre.trainer.convert.megatron_tensors`, the one `hf_to_megatron`
uses, so both give the same shard (tested).

Strict, as `load_hf_state_dict` is: the files' tensor names and shapes (read from their headers) are checked
against the config, and the converted names and shapes against the model, before any tensor's data is read.
Tolerated as in `gyre.models.hf_weights.load_pretrained`: `*.rotary_emb.inv_freq`, and a tied checkpoint's
`lm_head.weight` equal to the embedding (each rank compares its own rows of the two). docs/training.md,
"Sharded loading".
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from gyre.models.decoder_config import DecoderConfig
from gyre.models.hf_weights import IGNORED_SUFFIXES, checkpoint_files, hf_shapes, state_mismatch
from gyre.trainer.convert import (
    EXTRA_STATE,
    HFSource,
    StateDictSource,
    check_ranks,
    chunk_bounds,
    megatron_tensors,
    model_shapes,
    rank_layout,
    to_model_names,
)

__all__ = ["SafetensorsSource", "load_hf_checkpoint", "read_megatron_shard"]

TIED_COMPARE_ROWS = 4096  # rows of lm_head and the embedding compared at a time (a tied checkpoint's check)


class SafetensorsSource(HFSource):
    """The tensors of an HF checkpoint directory, read a slice at a time (each read opens its file and closes it, so
    no mapping of a file outlives the tensor it read). Names and shapes come from the files' headers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in checkpoint_files(self.path):
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name in self.file_of:
                        raise ValueError(
                            f"tensor {name!r} appears in more than one file of {self.path} (last: {file.name})"
                        )
                    self.file_of[name] = file
                    self.shapes[name] = tuple(reader.get_slice(name).get_shape())

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        with safe_open(str(self.file_of[name]), framework="pt", device="cpu") as reader:
            return reader.get_slice(name)[index]

    def full(self, name: str) -> torch.Tensor:
        return self._read(name, (slice(None),))

    def rows(self, name: str, parts: int, index: int) -> torch.Tensor:
        start, stop = chunk_bounds(self.shapes[name][0], parts, index)
        return self._read(name, (slice(start, stop),))

    def cols(self, name: str, parts: int, index: int) -> torch.Tensor:
        start, stop = chunk_bounds(self.shapes[name][1], parts, index)
        return self._read(name, (slice(None), slice(start, stop)))

    def check(self, config: DecoderConfig, *, tp_rank: int, tp_size: int) -> None:
        """ValueError unless the files hold exactly the config's tensors (tolerated extras aside); a tied
        checkpoint's `lm_head.weight` must equal the embedding on this rank's rows."""
        shapes = {name: shape for name, shape in self.shapes.items() if not name.endswith(IGNORED_SUFFIXES)}
        if config.tie_word_embeddings and "lm_head.weight" in shapes:
            if shapes["lm_head.weight"] != shapes.get("model.embed_tokens.weight"):
                self._tied_differs()
            start, stop = chunk_bounds(shapes["lm_head.weight"][0], tp_size, tp_rank)
            for row in range(start, stop, TIED_COMPARE_ROWS):
                rows = (slice(row, min(row + TIED_COMPARE_ROWS, stop)),)
                if not torch.equal(self._read("lm_head.weight", rows), self._read("model.embed_tokens.weight", rows)):
                    self._tied_differs()
            del shapes["lm_head.weight"]
        meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        mismatch = state_mismatch(meta, hf_shapes(config), line="{name}: file {got} vs config {want}")
        if mismatch:
            raise ValueError(
                f"checkpoint {self.path} does not match its config.json (model_type={config.model_type!r}): {mismatch}"
            )

    def _tied_differs(self) -> None:
        raise ValueError(
            f"{self.path}: tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
            "set tie_word_embeddings=false in config.json if the checkpoint has a separate lm_head"
        )


def read_megatron_shard(path: str | Path, config: DecoderConfig, **ranks: int) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one rank (`tp_rank`, `tp_size`, `pp_rank`, `pp_size`, and `ep_rank`, `ep_size` for
    a mixture of experts) read from `path`'s files, in the files' dtype (checked as `load_hf_checkpoint` checks)."""
    check_ranks(config, **ranks)
    source = SafetensorsSource(path)
    source.check(config, tp_rank=ranks["tp_rank"], tp_size=ranks["tp_size"])
    return dict(megatron_tensors(source, config, **ranks))


def load_hf_checkpoint(model: torch.nn.Module, path: str | Path, config: DecoderConfig) -> None:
    """Fill this rank's Megatron `model` from the HF checkpoint directory `path` (module docstring): everything is
    checked first, then each tensor is read, cast to its parameter's dtype and copied in, one at a time."""
    ranks = rank_layout()
    check_ranks(config, **ranks)
    source = SafetensorsSource(path)
    source.check(config, tp_rank=ranks["tp_rank"], tp_size=ranks["tp_size"])
    meta = StateDictSource({name: torch.empty(shape, device="meta") for name, shape in hf_shapes(config).items()})
    expected = model_shapes(model)
    plan = dict(megatron_tensors(meta, config, **ranks))
    planned = to_model_names(plan, expected)  # same order: Megatron name -> the model's name
    model_name = dict(zip(plan, planned, strict=True))
    mismatch = state_mismatch(planned, expected)
    if mismatch:
        raise ValueError(f"converted state dict does not match the Megatron model: {mismatch}")
    targets = {name: t for name, t in model.state_dict().items() if not name.endswith(EXTRA_STATE)}
    with torch.no_grad():
        for name, tensor in megatron_tensors(source, config, **ranks):
            targets[model_name[name]].copy_(tensor)
