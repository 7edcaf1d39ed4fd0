"""The SGLang adapter against the pinned SGLang's own source: every SGLang method `gyre/engine/sglang_engine.py`
calls exists with the arguments it passes, and every request type and sampling key it sends is a field SGLang has.

SGLang cannot be imported here (it needs CUDA torch), so its wheel (the version the `gpu` extra pins in
pyproject.toml) is downloaded once with `pip download --no-deps` into `~/.cache/gyre-test-sglang` and its Python
source parsed, never imported; no download (no network): skipped, with the reason. The adapter is parsed too, so
a call added to it is checked without a change here; a misspelled keyword, method or sampling key fails
(`test_a_misspelled_name_is_caught` mutates the adapter's source to show it). docs/sglang.md, "Checked against
SGLang's source".
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import gyre.engine.sglang_engine as adapter

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "gyre-test-sglang"


def pinned_version() -> str:
    match = re.search(r'"sglang==([0-9][0-9.]*)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml's gpu extra must pin sglang with =="
    return match.group(1)


SERVER_ARGS_FIELDS = "sglang/srt/arg_groups/fields/"  # ServerArgs is assembled from these namespaces (its docstring)
# Where the adapter's callees, their bases and the request types live (parsing all of sglang/srt takes ~10 s)
PARSED = (
    *(f"sglang/srt/{d}/" for d in ("managers", "entrypoints", "sampling", "utils", "arg_groups/fields")),
    "sglang/srt/server_args.py",
)


@dataclass
class SGLangSource:
    """Top-level classes of the `PARSED` files by name, from the wheel's text, and `ServerArgs`' fields."""

    classes: dict[str, list[ast.ClassDef]] = field(default_factory=dict)
    server_args: set[str] = field(default_factory=set)

    @classmethod
    def from_wheel(cls, wheel: Path) -> SGLangSource:
        source = cls()
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith(PARSED) and name.endswith(".py"):
                    for node in ast.parse(archive.read(name).decode()).body:
                        if isinstance(node, ast.ClassDef):
                            source.classes.setdefault(node.name, []).append(node)
                            if name.startswith(SERVER_ARGS_FIELDS):
                                source.server_args |= {
                                    ast.unparse(item.target) for item in node.body if isinstance(item, ast.AnnAssign)
                                }
        return source

    def _bases(self, name: str) -> list[str]:
        return [ast.unparse(b).split(".")[-1] for node in self.classes.get(name, []) for b in node.bases]

    def method(self, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for node in self.classes.get(cls, []):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item
        for base in self._bases(cls):
            found = self.method(base, name)
            if found is not None:
                return found
        return None

    def fields(self, cls: str) -> set[str]:
        """A dataclass's fields, its bases' included."""
        own = {
            ast.unparse(item.target)
            for node in self.classes.get(cls, [])
            for item in node.body
            if isinstance(item, ast.AnnAssign)
        }
        return own.union(*(self.fields(base) for base in self._bases(cls)))


@dataclass(frozen=True)
class Call:
    target: str  # "TokenizerManager.abort_request", "Engine.async_generate", "io.update_weights", "ServerArgs"
    positional: int
    keywords: tuple[str, ...]
    line: int


def _owner(node: ast.expr) -> str | None:
    text = ast.unparse(node)
    return {"self._manager": "TokenizerManager", "self._sgl": "Engine", "io": "io", "sglang": "sglang"}.get(text)


def adapter_calls(tree: ast.Module) -> list[Call]:
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = _owner(node.func.value)
            if owner is None:
                continue
            name = node.func.attr
            target = "ServerArgs" if (owner, name) == ("sglang", "Engine") else f"{owner}.{name}"
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            calls.append(Call(target, len(node.args), keywords, node.lineno))
    return calls


def io_classes(tree: ast.Module) -> dict[str, str]:
    """`SGLangIO` field -> what `load_sglang_io` puts there, as written (`io_struct.PauseGenerationReqInput`,
    `MultiprocessingSerializer.serialize`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "SGLangIO":
            return {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
    raise AssertionError("load_sglang_io builds no SGLangIO")


def dict_keys(tree: ast.Module, function_name: str) -> set[str]:
    """The keys the function `function_name` puts in the dicts it builds (`to_sglang_sampling_params`: SamplingParams
    fields; `sglang_engine_args`: ServerArgs fields)."""
    (function,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function_name]
    keys = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def _binds(function: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: tuple[str, ...]) -> str:
    """Why `positional` arguments and `keywords` do not bind to `function` (a method: self dropped); "" if they do."""
    args = function.args
    named = [a.arg for a in (*args.posonlyargs, *args.args)][1:]
    if positional > len(named) and args.vararg is None:
        return f"{positional} positional arguments, it takes {len(named)}"
    accepted = set(named[positional:]) | {a.arg for a in args.kwonlyargs}
    unknown = [k for k in keywords if k not in accepted]
    if unknown and args.kwarg is None:
        return f"keywords {unknown} are not among its parameters {sorted(accepted)}"
    return ""


def problems(adapter_source: str, sglang: SGLangSource) -> list[str]:
    """Every call, request type or sampling key of the adapter that the SGLang source does not have."""
    tree = ast.parse(adapter_source)
    io = io_classes(tree)
    out = []
    for call in adapter_calls(tree):
        owner, _, name = call.target.partition(".")
        where = f"line {call.line}: {call.target}"
        if owner in ("TokenizerManager", "Engine"):
            method = sglang.method(owner, name)
            if method is None:
                out.append(f"{where}: SGLang's {owner} has no method {name!r}")
            elif why := _binds(method, call.positional, call.keywords):
                out.append(f"{where}: {why}")
        elif owner == "io":
            source = io.get(name)
            parts = (source or "").split(".")
            if source is None:
                out.append(f"{where}: SGLangIO has no field {name!r}")
            elif len(parts) >= 2 and parts[-2] in sglang.classes:  # Class.method
                method = sglang.method(parts[-2], parts[-1])
                if method is None:
                    out.append(f"{where}: SGLang's {parts[-2]} has no method {parts[-1]!r}")
            elif unknown := sorted(set(call.keywords) - sglang.fields(parts[-1])):
                cls = parts[-1]
                out.append(f"{where}: {cls} has no fields {unknown} (it has {sorted(sglang.fields(cls))})")
        elif owner == "ServerArgs" and (unknown := sorted(set(call.keywords) - sglang.server_args)):
            out.append(f"{where}: ServerArgs has no fields {unknown}")
    # SamplingParams is a msgspec Struct: its constructor takes its fields as keywords
    if unknown := sorted(dict_keys(tree, "to_sglang_sampling_params") - sglang.fields("SamplingParams")):
        out.append(f"to_sglang_sampling_params: SamplingParams takes no {unknown}")
    if unknown := sorted(dict_keys(tree, "sglang_engine_args") - sglang.server_args):
        out.append(f"sglang_engine_args: ServerArgs has no fields {unknown}")
    for name in ("skip_tokenizer_init", "max_running_requests", "tp_size"):  # from_pretrained, read_limits
        if name not in sglang.server_args:
            out.append(f"ServerArgs has no field {name!r}")
    return out


@pytest.fixture(scope="module")
def sglang_source() -> SGLangSource:
    version = pinned_version()
    folder = CACHE / version
    wheels = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        wheels = sorted(folder.glob(f"sglang-{version}-*.whl"))
        if not wheels:
            pytest.skip(
                f"sglang=={version}'s wheel could not be downloaded (pip download: {done.stderr.strip()[-300:]})"
            )
    return SGLangSource.from_wheel(wheels[0])


def test_the_adapter_calls_only_what_the_pinned_sglang_has(sglang_source):
    source = Path(adapter.__file__).read_text()
    calls = {call.target for call in adapter_calls(ast.parse(source))}
    assert {"Engine.async_generate", "TokenizerManager.update_weights_from_tensor", "io.update_weights"} <= calls
    session = {  # a weight-update session: one update per bucket, flushed after (gyre.engine.protocol, begin_update)
        "TokenizerManager.begin_weight_update",
        "TokenizerManager.end_weight_update",
        "TokenizerManager.update_weights_from_distributed",
        "TokenizerManager.flush_cache",
        "TokenizerManager.pause_generation",
        "TokenizerManager.continue_generation",
        "io.begin_update",
        "io.end_update",
        "io.update_distributed",
    }
    assert session <= calls, session - calls
    assert len(calls) >= 12, calls  # the parse finds the adapter's calls, not a few of them
    assert problems(source, sglang_source) == []


@pytest.mark.parametrize(
    ("original", "misspelled", "reported"),
    [
        (
            "serialized_named_tensors=payload, load_format=None",
            "serialized_named_tensors=payload, load_fromat=None",
            "UpdateWeightsFromTensorReqInput has no fields ['load_fromat']",
        ),
        ("master_port=port", "master_prot=port", "InitWeightsUpdateGroupReqInput has no fields ['master_prot']"),
        (
            "flush_cache=False, weight_version=str(session.version)\n",
            "flush_cache=False, weight_versoin=str(session.version)\n",
            "UpdateWeightsFromTensorReqInput has no fields ['weight_versoin']",
        ),
        (
            "weight_version=str(session.version),",
            "weight_verison=str(session.version),",
            "UpdateWeightsFromDistributedReqInput has no fields ['weight_verison']",
        ),
        (
            "self._manager.begin_weight_update(",
            "self._manager.begin_weight_updates(",
            "no method 'begin_weight_updates'",
        ),
        ("self._manager.pause_generation(", "self._manager.pause_generations(", "no method 'pause_generations'"),
        ("rid=request.request_id,", "request_id=request.request_id,", "keywords ['request_id']"),
        ('"min_new_tokens": 0', '"min_new_token": 0', "SamplingParams takes no ['min_new_token']"),
        ("io.pause(mode=", "io.pause(mood=", "PauseGenerationReqInput has no fields ['mood']"),
        ("MultiprocessingSerializer.serialize,", "MultiprocessingSerializer.serialise,", "no method 'serialise'"),
        ('"enable_memory_saver": True', '"enable_mem_saver": True', "ServerArgs has no fields ['enable_mem_saver']"),
    ],
)
def test_a_misspelled_name_is_caught(sglang_source, original, misspelled, reported):
    source = Path(adapter.__file__).read_text()
    assert source.count(original) == 1, original
    found = problems(source.replace(original, misspelled), sglang_source)
    assert len(found) == 1 and reported in found[0], found


# ----------------------------------------------------------------- the stand-in (gyre.engine.sglang_standin)

STANDIN_CLASSES = {  # stand-in file -> the classes there that model SGLang's classes of the same name
    "srt/entrypoints/engine.py": ("Engine",),
    "srt/managers/tokenizer_manager.py": ("TokenizerManager",),
    "srt/utils/__init__.py": ("MultiprocessingSerializer",),
}
STANDIN_REQUESTS = "srt/managers/io_struct.py"


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} - {"self"}


def standin_problems(folder: Path, sglang: SGLangSource) -> list[str]:
    """Everything the stand-in models that the pinned SGLang does not have: a public method (its parameters among
    the real method's), a request type's field, a ServerArgs field it accepts."""
    out = []
    for path, names in STANDIN_CLASSES.items():
        for node in ast.parse((folder / path).read_text()).body:
            if not isinstance(node, ast.ClassDef) or node.name not in names:
                continue
            for item in node.body:
                if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) or item.name.startswith("_"):
                    continue
                real = sglang.method(node.name, item.name)
                if real is None:
                    out.append(f"{path}: SGLang's {node.name} has no method {item.name!r}")
                elif extra := sorted(_parameters(item) - _parameters(real)):
                    out.append(f"{path}: {node.name}.{item.name} has parameters {extra} SGLang's has not")
    for node in ast.parse((folder / STANDIN_REQUESTS).read_text()).body:
        if isinstance(node, ast.ClassDef):
            fields = {ast.unparse(i.target) for i in node.body if isinstance(i, ast.AnnAssign)}
            if node.name not in sglang.classes:
                out.append(f"{STANDIN_REQUESTS}: SGLang has no class {node.name}")
            elif extra := sorted(fields - sglang.fields(node.name)):
                out.append(f"{STANDIN_REQUESTS}: {node.name} has fields {extra} SGLang's has not")
    engine = ast.parse((folder / "srt/entrypoints/engine.py").read_text())
    (accepted,) = [
        n.value
        for n in ast.walk(engine)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "ACCEPTED_SERVER_ARGS"
    ]
    names = {c.value for c in ast.walk(accepted) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    if extra := sorted(names - sglang.server_args):
        out.append(f"ACCEPTED_SERVER_ARGS: ServerArgs has no fields {extra}")
    return out


def test_the_standin_models_only_what_the_pinned_sglang_has(sglang_source):
    from gyre.engine.sglang_standin import PATH

    assert standin_problems(PATH / "sglang", sglang_source) == []


@pytest.mark.parametrize(
    ("path", "original", "misspelled", "reported"),
    [
        (
            "srt/managers/tokenizer_manager.py",
            "def abort_request(self, rid",
            "def abort_request(self, request_id",
            "parameters ['request_id']",
        ),
        ("srt/managers/io_struct.py", "    mode: str", "    mood: str", "PauseGenerationReqInput has fields ['mood']"),
        ("srt/entrypoints/engine.py", '"random_seed",', '"random_seeds",', "ServerArgs has no fields ['random_seeds']"),
    ],
)
def test_a_standin_that_invents_a_name_is_caught(tmp_path, sglang_source, path, original, misspelled, reported):
    import shutil

    from gyre.engine.sglang_standin import PATH

    copy = shutil.copytree(PATH / "sglang", tmp_path / "sglang")
    text = (copy / path).read_text()
    assert text.count(original) == 1, original
    (copy / path).write_text(text.replace(original, misspelled))
    found = standin_problems(copy, sglang_source)
    assert len(found) == 1 and reported in found[0], found
