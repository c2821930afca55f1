"""Build the engine image (docker/Dockerfile) with docker or podman: `make container`.

With a Docker engine, `docker build` on the official base images. Otherwise podman,
set up for these machines: the runtime runc, ulimits no higher than the host's, overlay
storage of its own under `.refold/container/` (REFOLD_CONTAINER_HOME), host networking.
Where the official base images cannot be pulled (no container registry reachable), the
build uses stand-ins made from Debian's packages, under the official names in that
storage only:

- `python:3.11-slim-bookworm`: a Debian bookworm root filesystem with Python 3.11
  (`mmdebstrap`, cached by its inputs under `.refold/container/cache/`), `podman import`ed;
- the Rust stage: a wheel of the native core built on this host (`pip wheel ./native`),
  handed to the build as the image the `NATIVE_WHEELS` build argument names.

The host's CA certificates reach the build's downloads as build secrets (pip's bundle,
Maven's Java trust store); they are never in the image.

    python -m refold.dev.container build [--tag refold-engine:latest] [--standins auto|yes|no]
    python -m refold.dev.container podman ARGS…   # podman on that storage (run, images, …)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from refold.environment import checkout_root

PYTHON_IMAGE = "python:3.11-slim-bookworm"
# the stand-in for PYTHON_IMAGE: what the official slim image holds that the build uses
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# podman's settings on these machines: crun refuses the host's cgroup v1 hybrid mode,
# and a container may not ask for more open files or processes than the host allows
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_JAVA_CACERTS = Path("/etc/ssl/certs/java/cacerts")
BUILD_ATTEMPTS = 2  # the build downloads from Debian, PyPI and Maven Central


class ContainerError(RuntimeError):
    pass


def repo_root() -> Path:
    root = checkout_root()
    if root is None:
        raise ContainerError("building the image needs the repository (docker/Dockerfile): run from a checkout")
    return root


def container_home() -> Path:
    return Path(os.environ.get("REFOLD_CONTAINER_HOME") or repo_root() / ".refold" / "container")


def docker_available() -> bool:
    """A Docker engine answers (a docker client alone is not enough)."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Podman:
    """podman with its own storage and settings under `home`."""

    def __init__(self, home: Path | None = None) -> None:
        if shutil.which("podman") is None:
            raise ContainerError("podman is not installed (Debian: apt-get install podman buildah runc mmdebstrap)")
        self.home = (home or container_home()).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        storage = self.home / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f'runroot = "{self.home / "run"}"\n'
            f'graphroot = "{self.home / "storage"}"\n'
        )
        conf = self.home / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage), "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, capture: bool = True,
                 timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["podman", *args], env=self.env, text=True, timeout=timeout,
                              capture_output=capture)
        if check and done.returncode != 0:
            detail = (done.stderr or "")[-3000:] if capture else ""
            raise ContainerError(f"podman {' '.join(args[:3])} … failed ({done.returncode}): {detail}")
        return done

    def stream(self, *args: str, tail: int = 40) -> str | None:
        """podman ARGS with its output passed on as it comes; None when it succeeds, else
        its exit status, its last lines and the free space of the storage."""
        with subprocess.Popen(["podman", *args], env=self.env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as proc:
            assert proc.stdout is not None
            last: deque[str] = deque(maxlen=tail)
            for line in proc.stdout:
                sys.stdout.write(line)
                last.append(line)
        if proc.returncode == 0:
            return None
        free = shutil.disk_usage(self.home).free
        return (f"exit status {proc.returncode}, {free / 1e9:.1f} GB free under {self.home}; "
                f"its last lines:\n{''.join(last)}")

    def exists(self, image: str) -> bool:
        return self("image", "exists", image, check=False).returncode == 0


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def standin_rootfs(home: Path) -> Path:
    """The Debian root filesystem standing in for PYTHON_IMAGE, made once per inputs."""
    key = _digest(SUITE, *PACKAGES, *MIRRORS)
    cache = home / "cache"
    target = cache / f"rootfs-{SUITE}-{key}.tar"
    if target.exists():
        return target
    if shutil.which("mmdebstrap") is None:
        raise ContainerError("mmdebstrap is not installed (Debian: apt-get install mmdebstrap)")
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    command = [
        "mmdebstrap", "--quiet", "--variant=apt", f"--include={','.join(PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--format=tar", SUITE, str(partial), *MIRRORS,
    ]
    print(f"refold container: making the stand-in for {PYTHON_IMAGE} (mmdebstrap, once) …", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ContainerError(f"mmdebstrap failed ({done.returncode}): {done.stderr[-3000:]}")
    partial.rename(target)
    return target


def ensure_python_standin(podman: Podman) -> None:
    """PYTHON_IMAGE in podman's storage: the imported stand-in root filesystem."""
    rootfs = standin_rootfs(podman.home)
    marker = f"localhost/refold-standin-python:{rootfs.stem.rsplit('-', 1)[-1]}"
    if not podman.exists(marker):
        podman("import", "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]', str(rootfs), marker)
    for name in (f"docker.io/library/{PYTHON_IMAGE}", f"localhost/{PYTHON_IMAGE}"):
        podman("tag", marker, name)


def native_wheel_image(podman: Podman, root: Path) -> str:
    """An image holding /wheels/refold_native-*.whl built on this host, keyed by the native sources."""
    native = root / "native"
    sources = sorted(p for p in native.rglob("*") if p.is_file() and "target" not in p.relative_to(native).parts)
    key = _digest(sys.version, *(str(p.relative_to(root)) for p in sources), *(p.read_bytes() for p in sources))
    image = f"localhost/refold-native-wheels:{key}"
    if podman.exists(image):
        return image
    with tempfile.TemporaryDirectory(dir=podman.home) as tmp:
        wheels = Path(tmp)
        print("refold container: building the native core's wheel on the host (pip wheel ./native) …",
              file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(native),
                               "-w", str(wheels)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ContainerError(f"pip wheel ./native failed: {done.stderr[-3000:]}")
        (wheels / "Containerfile").write_text("FROM scratch\nCOPY *.whl /wheels/\n")
        podman("build", "--quiet", "--network=host", "-t", image, str(wheels))
    return image


def _registry_reachable(podman: Podman) -> bool:
    if podman.exists(f"docker.io/library/{PYTHON_IMAGE}") and not podman.exists(
            f"localhost/{PYTHON_IMAGE}"):
        return True  # the official image, pulled before
    try:
        return podman("pull", "--quiet", f"docker.io/library/{PYTHON_IMAGE}", check=False,
                      timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def podman_build(podman: Podman, tag: str, *, standins: bool, root: Path | None = None) -> float:
    """Build docker/Dockerfile into `tag`; returns the seconds the build took."""
    root = root or repo_root()
    args = ["build", "--format", "docker", "--network=host", "-f", str(root / "docker" / "Dockerfile"), "-t", tag]
    if standins:
        ensure_python_standin(podman)
        args += ["--pull=never", "--build-arg", f"NATIVE_WHEELS={native_wheel_image(podman, root)}"]
    # the host's trust for the build's downloads only: build secrets are never in a layer
    if HOST_CA_BUNDLE.is_file():
        args += ["--secret", f"id=ca-bundle,src={HOST_CA_BUNDLE}"]
    if HOST_JAVA_CACERTS.is_file():
        args += ["--secret", f"id=java-cacerts,src={HOST_JAVA_CACERTS}"]
    started = time.monotonic()
    for attempt in range(1, BUILD_ATTEMPTS + 1):
        failure = podman.stream(*args, str(root))
        if failure is None:
            return time.monotonic() - started
        if attempt < BUILD_ATTEMPTS:  # a mirror's hiccup: again, from the layers already built
            print(f"refold container: the build failed ({failure.splitlines()[0]}); once more …", file=sys.stderr)
    raise ContainerError(f"podman build of {tag} failed {BUILD_ATTEMPTS} times; the last: {failure}")


def image_size(podman: Podman, image: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refold.dev.container", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build docker/Dockerfile")
    build.add_argument("--tag", default="refold-engine:latest")
    build.add_argument("--standins", choices=["auto", "yes", "no"], default="auto",
                       help="podman: build on stand-in base images (auto: when the official ones cannot be pulled)")
    build.add_argument("--engine", choices=["auto", "docker", "podman"], default="auto")
    run = sub.add_parser("podman", help="podman on the storage the builds use, e.g. `podman images`")
    run.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "podman":
            return Podman()(*args.args, check=False, capture=False).returncode
        root = repo_root()
        engine = args.engine
        if engine == "auto":
            engine = "docker" if docker_available() else "podman"
        if engine == "docker":
            return subprocess.run(["docker", "build", "-f", str(root / "docker" / "Dockerfile"),
                                   "-t", args.tag, str(root)]).returncode
        podman = Podman()
        standins = args.standins == "yes" or (args.standins == "auto" and not _registry_reachable(podman))
        seconds = podman_build(podman, args.tag, standins=standins, root=root)
        size = image_size(podman, args.tag)
        print(f"refold container: {args.tag} built with podman in {seconds:.0f} s"
              f"{' on stand-in base images' if standins else ''}; {size / 1e6:.0f} MB\n"
              f"run it with: {Path(sys.executable).parent / 'python'} -m refold.dev.container podman run --rm --init --network=host "
              f"-e REFOLD_BOOTSTRAP_SERVERS=127.0.0.1:9092 -v $PWD/docker/pipeline.yaml:/pipeline/pipeline.yaml:ro "
              f"{args.tag}")
        return 0
    except ContainerError as exc:
        print(f"refold container: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
