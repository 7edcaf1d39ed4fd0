"""Load and save the shared decoder in HF layout: `config.json` + safetensors with HF parameter names.

Contract
- `load_pretrained(path, dtype, device)` reads `config.json` (via `DecoderConfig.from_hf`) and either the
  shards named by `model.safetensors.index.json` or every `*.safetensors` file in the directory. It is strict:
  any missing or unexpected tensor name, or a shape that does not match the config, raises a ValueError that
  lists them. Tolerated extras, as in transformers: `*.rotary_emb.inv_freq` buffers of old checkpoints, and
  an `lm_head.weight` equal to the embedding in a tied checkpoint.
- Mixture-of-experts checkpoints (qwen3_moe, qwen2_moe) carry one tensor per expert
  (`model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`, as the hub's Qwen checkpoints and transformers'
  save_pretrained write them). `read_state_dict` also accepts transformers 5's in-memory fused layout
  (`mlp.experts.gate_up_proj` `[E, 2 * I, H]`, gate rows first, and `mlp.experts.down_proj` `[E, H, I]`) and splits
  it into those per-expert names (`split_fused_experts`); `save_pretrained` writes per-expert names.
- `save_pretrained(model, path, max_shard_bytes=None)` writes the same layout (`model.safetensors`, or
  `model-0000k-of-0000n.safetensors` + index when the tensors exceed `max_shard_bytes`), loadable by
  transformers' `AutoModelForCausalLM.from_pretrained` as well as by `load_pretrained`.
- The pieces for a checkpoint written by several processes, tensor by tensor (the run's policy directory,
  `gyre.runtime.job.policy_dir`): `hf_shapes(config)` (the tensors a checkpoint of `config` holds),
  `save_tensors(tensors, file)` (one safetensors file of whole tensors, dtype kept), `tensor_file_specs(file)` (a
  file's tensors' dtypes, shapes and sizes, from its header alone) and `write_config(config, path, dtype)`.
- `load_pretrained` resolves a symbolic link once, first (`<run dir>/policy` names the run's latest policy): every
  file it reads is of the one directory the link named then.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig, read_config

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints carry
FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"  # transformers 5 in memory
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def checkpoint_files(path: str | Path) -> list[Path]:
    """Safetensors files of a checkpoint: the index's shards if an index exists, else every `*.safetensors`."""
    path = Path(path)
    index_path = path / INDEX_NAME
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index_path} names shards that are not in {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def read_state_dict(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint by HF name, cast to `dtype` on `device`, each in memory of its own; a name in two
    files is an error.

    Of its own: safetensors 0.8 hands out CPU tensors at the file's byte offsets, not 64-byte aligned, and torch's
    vectorized CPU kernels then sum in another order: a reloaded model's logits differed from the saved model's by
    ~1e-6 (tests/unit/test_models_moe.py, "the checkpoint round trip"). A tensor `.to` did not copy is cloned into
    torch's own (aligned) allocation, so a checkpoint computes exactly what the model that wrote it did."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in state:
                    raise ValueError(f"tensor {name!r} appears in more than one file of {path} (last: {file.name})")
                raw = reader.get_tensor(name)
                tensor = raw.to(device=device, dtype=dtype)
                state[name] = tensor.clone() if tensor.data_ptr() == raw.data_ptr() else tensor
    return split_fused_experts(state)


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with transformers 5's fused expert tensors (`{p}.mlp.experts.gate_up_proj` `[E, 2I, H]`,
    `{p}.mlp.experts.down_proj` `[E, H, I]`) replaced by per-expert `{p}.mlp.experts.{j}.{gate,up,down}_proj.weight`
    (views, no copy); a state without them is returned as is. A fused tensor whose shape cannot be split raises
    ValueError naming it."""
    if not any(name.endswith((FUSED_GATE_UP, FUSED_DOWN)) for name in state):
        return state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(FUSED_GATE_UP):
            prefix = name.removesuffix("gate_up_proj")
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(
                    f"{name}: expected [num_experts, 2 * moe_intermediate_size, hidden], got {tuple(tensor.shape)}"
                )
            for j, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor.unbind(0)):
                out[f"{prefix}{j}.gate_proj.weight"] = gate
                out[f"{prefix}{j}.up_proj.weight"] = up
        elif name.endswith(FUSED_DOWN):
            prefix = name.removesuffix("down_proj")
            if tensor.dim() != 3:
                raise ValueError(
                    f"{name}: expected [num_experts, hidden, moe_intermediate_size], got {tuple(tensor.shape)}"
                )
            for j, down in enumerate(tensor.unbind(0)):
                out[f"{prefix}{j}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def without_tolerated(state: dict[str, torch.Tensor], config: DecoderConfig, *, where: str) -> dict[str, torch.Tensor]:
    """`state` without the extras transformers tolerates: `*.rotary_emb.inv_freq` buffers, and an `lm_head.weight`
    equal to the embedding when the config ties them (a different one is a ValueError naming `where`)."""
    state = {name: t for name, t in state.items() if not name.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" in state:
        embed = state.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(state["lm_head.weight"], embed):
            raise ValueError(
                f"{where}: tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                "set tie_word_embeddings=false in config.json if the checkpoint has a separate lm_head"
            )
        del state["lm_head.weight"]
    return state


def state_mismatch(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    *,
    line: str = "{name}: got {got}, expected {want}",
) -> str | None:
    """'missing [...]; unexpected [...]; wrong shape [...]' when `state`'s names or shapes differ from `expected`
    (each wrong shape written with `line`); None when they match."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = sorted(
        line.format(name=n, got=tuple(state[n].shape), want=tuple(expected[n]))
        for n in set(expected) & set(state)
        if tuple(state[n].shape) != tuple(expected[n])
    )
    if not (missing or unexpected or wrong_shape):
        return None
    return f"missing {missing}; unexpected {unexpected}; wrong shape {wrong_shape}"


def hf_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of `config` (the native model's parameters, built on the meta device)."""
    with torch.device("meta"):
        model = DecoderLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DecoderLM:
    """The model of an HF-layout directory (a symbolic link resolved first), in eval mode, with parameters of `dtype`
    on `device`."""
    path = Path(path).resolve()
    config = read_config(path)
    state = read_state_dict(path, dtype=dtype, device=device)
    with torch.device("meta"):
        model = DecoderLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    state = without_tolerated(state, config, where=str(path))
    mismatch = state_mismatch(state, expected, line="{name}: file {got} vs config {want}")
    if mismatch:
        raise ValueError(
            f"checkpoint {path} does not match its config.json (model_type={config.model_type!r}): {mismatch}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def save_pretrained(model: DecoderLM, path: str | Path, *, max_shard_bytes: int | None = None) -> list[Path]:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`); returns the files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # copy=True: a model the engine serves has stacked projections (gyre.engine.decode) that make q/k/v (gate/up)
    # parameters views of one tensor, and safetensors refuses tensors that share memory.
    state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}
    write_config(model.config, path, next(iter(state.values())).dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    # Remove files of an earlier save in another layout, so the directory holds exactly one checkpoint.
    for old in [*path.glob("*.safetensors"), path / INDEX_NAME]:
        old.unlink(missing_ok=True)
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=metadata)
        return [path / CONFIG_NAME, path / SINGLE_FILE]
    files, weight_map = [], {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
        files.append(path / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [path / CONFIG_NAME, *files, path / INDEX_NAME]


def write_config(config: DecoderConfig, path: str | Path, dtype: torch.dtype) -> Path:
    """`path/config.json` of `config`, its `torch_dtype` the weights' `dtype`; the file."""
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    file = Path(path) / CONFIG_NAME
    file.write_text(json.dumps(hf_config, indent=2) + "\n")
    return file


def save_tensors(tensors: Mapping[str, torch.Tensor], file: str | Path) -> int:
    """One safetensors file of `tensors` as they are (dtype kept), as an HF checkpoint's shard: each on the CPU and
    contiguous (moved or copied when not), a tensor that shares memory with an earlier one copied (safetensors
    refuses shared memory). The bytes of tensor data written."""
    state: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        state[name] = cpu.clone() if storage in storages else cpu
        storages.add(storage)
    save_file(state, str(file), metadata={"format": "pt"})  # transformers refuses safetensors without the format
    return sum(t.numel() * t.element_size() for t in state.values())


def tensor_file_specs(file: str | Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Name -> (safetensors dtype such as "BF16", shape, bytes) of every tensor of a safetensors file, read from its
    header alone (8 bytes little-endian: the header's length, then the header as JSON); ValueError naming the file
    when it is no safetensors file."""
    with open(file, "rb") as handle:
        head = handle.read(8)
        try:
            (length,) = struct.unpack("<Q", head)
            header = json.loads(handle.read(length))
            header.pop("__metadata__", None)
            return {
                name: (spec["dtype"], tuple(spec["shape"]), spec["data_offsets"][1] - spec["data_offsets"][0])
                for name, spec in header.items()
            }
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from error


def checkpoint_buckets(path: Path, *, dtype: torch.dtype, bucket_bytes: int) -> Iterator:
    """The tensors of the HF-layout directory `path`, cast to `dtype`, as `FlatWeights` buckets of about
    `bucket_bytes` (a tensor at a time is read; a bigger one alone): what an engine loads a policy directory from."""
    from gyre.models.flat_weights import flatten_weights

    held: dict = {}
    size = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = tensors.get_tensor(name)
                tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
                if held and size + tensor.nbytes > bucket_bytes:
                    yield flatten_weights(held)
                    held, size = {}, 0
                held[name] = tensor
                size += tensor.nbytes
    if held:
        yield flatten_weights(held)
