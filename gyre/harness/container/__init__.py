"""The container sandbox: each execution in one podman or docker container of its task's image (docs/harness.md,
"The container sandbox"). `engine` is the engine's CLI, `images` prepares each task's image, `network` forwards the
proxy into a container's own network namespace, `sandbox` is the lifecycle."""
