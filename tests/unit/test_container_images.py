"""Which image a task runs in (`gyre.harness.container.images.ImageSet.source`) and the task format's
`[environment]` table (`gyre.tasks.spec`): pure, no engine runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.harness.container.engine import ContainerEngine, EngineError
from gyre.harness.container.images import ImageSet, ImageUnavailable, build_tag, context_digest
from gyre.tasks.spec import TaskError, load_task


def make_task(root: Path, environment: str = "", dockerfile: str | None = None) -> Path:
    (root / "workspace").mkdir(parents=True)
    (root / "task.toml").write_text(
        f'id = "{root.name}"\nprompt = "p"\n'
        + '[evaluator]\nkind = "command"\ncommand = "python3 check.py"\nscore = "float"\n'
        + environment
    )
    if dockerfile is not None:
        (root / "environment").mkdir()
        (root / "environment" / "Dockerfile").write_text(dockerfile)
    return root


def images(default: str = "") -> ImageSet:
    return ImageSet(ContainerEngine(kind="podman", binary="/nonexistent/podman"), default_image=default)


def test_a_named_image_a_build_context_or_the_default(tmp_path):
    named = load_task(make_task(tmp_path / "a", '[environment]\nimage = "python:3.9-slim"\nbuild_timeout_s = 5\n'))
    source = images("base:1").source(named)
    assert (source.ref, source.context, source.timeout_s) == ("python:3.9-slim", None, 5.0)

    built = load_task(make_task(tmp_path / "b", dockerfile="FROM base:1\nRUN true\n"))
    source = images("base:1").source(built)
    assert source.context == (tmp_path / "b" / "environment").resolve()
    assert source.ref == build_tag(source.context) and source.ref.startswith("gyre-task:")

    plain = load_task(make_task(tmp_path / "c"))
    assert images("base:1").source(plain).ref == "base:1"
    with pytest.raises(ImageUnavailable, match=r"harness\.container\.image is empty"):
        images("").source(plain)


def test_the_build_tag_follows_the_content_only(tmp_path):
    one = make_task(tmp_path / "one", dockerfile="FROM base:1\n") / "environment"
    two = make_task(tmp_path / "two", dockerfile="FROM base:1\n") / "environment"
    assert context_digest(one) == context_digest(two)  # same content in another directory: the same image
    (two / "extra.txt").write_text("x")
    assert context_digest(one) != context_digest(two)
    (two / "extra.txt").unlink()
    (two / "Dockerfile").chmod(0o600)
    assert context_digest(one) != context_digest(two)  # a mode is part of what COPY copies


@pytest.mark.parametrize(
    ("environment", "dockerfile", "message"),
    [
        ('[environment]\nimage = "a b"\n', None, "an image reference"),
        ('[environment]\nimage = "--volume=/:/host"\n', None, "not starting with one"),
        ('[environment]\nworkdir = "/w:/etc"\n', None, "no ':' or ','"),
        ('[environment]\nimage = "x:1"\n', "FROM y\n", "not both"),
        ("[environment]\ncpus = 0\n", None, "a positive number"),
        ("[environment]\nmemory_mb = 1.5\n", None, "integer"),
        ("[environment]\npids = -1\n", None, "a positive integer"),
        ('[environment]\nworkdir = "rel"\n', None, "absolute path"),
        ("[environment]\nallow_internet = 1\n", None, "true or false"),
        ('[environment]\nimgae = "x"\n', None, "unknown field"),
    ],
)
def test_bad_environment_fields_name_the_field(tmp_path, environment, dockerfile, message):
    with pytest.raises(TaskError, match=message) as error:
        load_task(make_task(tmp_path, environment, dockerfile))
    assert "environment." in str(error.value)


def test_a_program_only_the_image_has_is_accepted_for_a_task_with_its_own_image(tmp_path):
    command = '[evaluator]\nkind = "command"\ncommand = "only-in-image --check"\nscore = "float"\n'
    root = tmp_path / "t"
    (root / "workspace").mkdir(parents=True)
    (root / "task.toml").write_text(f'id = "t"\nprompt = "p"\n{command}[environment]\nimage = "img:1"\n')
    assert load_task(root).evaluator.argv[0] == "only-in-image"
    (root / "task.toml").write_text(f'id = "t"\nprompt = "p"\n{command}')
    with pytest.raises(TaskError, match="not found on PATH"):
        load_task(root)


class CountingEngine(ContainerEngine):
    """The engine's image calls only, counted (no engine runs): an image exists once built."""

    def __post_init__(self) -> None:
        self.kind, self.binary, self.built, self.pulled = "podman", "/nonexistent/podman", [], []

    def image_exists(self, ref: str) -> bool:
        return ref in self.built

    def build(self, context, tag, *, labels, timeout_s) -> None:
        if (context / "FAIL").exists():
            raise EngineError(f"podman build: step 2 failed in {context}")
        self.built.append(tag)

    def pull(self, ref, *, timeout_s) -> None:
        self.pulled.append(ref)
        raise EngineError(f"podman pull: {ref}: manifest unknown")


def test_each_image_is_made_once_and_a_failure_is_kept(tmp_path, caplog):
    from gyre.harness.container import images as images_module

    tasks = [load_task(make_task(tmp_path / f"same-{i}", dockerfile="FROM base:1\n")) for i in range(3)]
    failing = load_task(make_task(tmp_path / "fails", dockerfile="FROM base:1\nRUN false\n"))
    (failing.environment.build_context / "FAIL").write_text("")
    missing = load_task(make_task(tmp_path / "pull", '[environment]\nimage = "nowhere/none:1"\n'))
    engine = CountingEngine()
    images_module._RESULTS.clear()
    image_set = ImageSet(engine, max_preparing=2)
    failures = image_set.prepare([*tasks, failing, missing])
    assert len(engine.built) == 1  # three build contexts of the same content: one image
    assert sorted(failures) == ["fails", "pull"]
    assert image_set.image_for(tasks[2]) == engine.built[0]
    with pytest.raises(ImageUnavailable, match="manifest unknown"):
        image_set.image_for(missing)
    with pytest.raises(ImageUnavailable, match="step 2 failed"):
        image_set.image_for(failing)
    image_set.prepare([failing, missing])
    assert engine.pulled == ["nowhere/none:1"] and len(engine.built) == 1  # no second try of either
    images_module._RESULTS.clear()
