#!/usr/bin/env python3
"""Build (once) an engine runtime venv from its pinned requirements file, in a cache keyed by the file's digest.

    python3 infra/runtimes/build.py main            -> prints ~/.cache/baton/runtimes/main-<digest>
    python3 infra/runtimes/build.py main --overlay .venv

A runtime is `infra/runtimes/<name>.txt` (what we ask for), its generated `<name>.lock` (every transitive package pinned
with its sha256, `make lock`; installed with `--require-hashes --no-deps` so every build is the same) and an optional
`<name>.post.sh` run inside the new venv (for the fixes an engine needs, e.g. removing CUDA wheels). All three feed
the digest, so editing any of them rebuilds.
`--overlay DIR` makes DIR a small venv that sees the cached runtime's packages plus this checkout (through .pth files)
and has wrappers for the runtime's console scripts: every clone gets its own `.venv` without reinstalling 2 GB.
Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("BATON_RUNTIME_CACHE", Path.home() / ".cache" / "baton" / "runtimes"))


def digest(name: str, folder: Path = HERE) -> str:
    h = hashlib.sha256()
    for suffix in (".txt", ".lock", ".post.sh"):
        f = folder / f"{name}{suffix}"
        if f.exists():
            h.update(f.read_bytes())
    h.update(sys.version.split()[0].encode())
    return h.hexdigest()[:12]


def runtime_dir(name: str) -> Path:
    return CACHE / f"{name}-{digest(name)}"


def log(msg: str) -> None:
    print(f"[runtimes] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict | None = None) -> None:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    noisy = "is ignored: it is neither a file nor a directory"
    out = "\n".join(line for line in proc.stdout.splitlines() if noisy not in line)
    if proc.returncode != 0:
        print(out[-8000:], file=sys.stderr)
        raise SystemExit(f"[runtimes] command failed with exit code {proc.returncode}: {' '.join(cmd)}")


def build(name: str) -> Path:
    req = HERE / f"{name}.txt"
    if not req.exists():
        raise SystemExit(f"[runtimes] no such runtime: {req}")
    target = runtime_dir(name)
    if (target / ".baton-ready").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel builders wait for the first one
        if (target / ".baton-ready").exists():
            return target
        # venvs hard-code their own path in scripts, so build in place; the marker file makes it valid.
        shutil.rmtree(target, ignore_errors=True)
        t0 = time.time()
        log(f"building runtime '{name}' into {target} (once per requirements digest)")
        run([sys.executable, "-m", "venv", str(target)])
        py = str(target / "bin" / "python")
        env = dict(os.environ, DS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
        run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], env)
        run([py, "-m", "pip", "install", "-q", *install_args(name)], env)
        post = HERE / f"{name}.post.sh"
        if post.exists():
            run(["bash", str(post), str(target)], env)
        (target / ".baton-ready").write_text(f"built in {time.time() - t0:.0f}s\n")
        log(f"runtime '{name}' ready in {time.time() - t0:.0f}s")
    return target


def install_args(name: str) -> list[str]:
    """The locked set when there is one (hash-checked, nothing resolved at build time), else the plain requirements."""
    lock = HERE / f"{name}.lock"
    if lock.exists():
        return ["--require-hashes", "--no-deps", "-r", str(lock)]
    return ["-r", str(HERE / f"{name}.txt")]


def site_packages(venv: Path) -> Path:
    out = subprocess.check_output(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    )
    return Path(out.strip())


def overlay(runtime: Path, dest: Path) -> None:
    """A venv at dest that imports the runtime's packages and this checkout, with wrappers for its console scripts."""
    marker = dest / ".baton-overlay"
    if marker.exists() and marker.read_text().strip() == str(runtime):
        return
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    shutil.rmtree(dest, ignore_errors=True)
    base = subprocess.check_output([str(runtime / "bin" / "python"), "-c", "import sys; print(sys._base_executable)"],
                                   text=True).strip()
    subprocess.check_call([base, "-m", "venv", "--without-pip", str(dest)])
    sp = site_packages(dest)
    (sp / "_baton_runtime.pth").write_text(f"import site; site.addsitedir({str(site_packages(runtime))!r})\n")
    (sp / "_baton_checkout.pth").write_text(str(REPO) + "\n")
    py = dest / "bin" / "python"
    for script in sorted((runtime / "bin").iterdir()):
        if script.name.startswith(("python", "pip", "activate", "Activate")) or not script.is_file():
            continue
        head = script.read_bytes()[:200]
        if not head.startswith(b"#!") or b"python" not in head.split(b"\n", 1)[0]:
            continue
        body = script.read_text().split("\n", 1)[1]
        (dest / "bin" / script.name).write_text(f"#!{py}\n{body}")
        (dest / "bin" / script.name).chmod(0o755)
    (dest / "bin" / "baton").write_text(f"#!{py}\nimport sys\nfrom flows.cli import main\nsys.exit(main())\n")
    (dest / "bin" / "baton").chmod(0o755)
    marker.write_text(str(runtime) + "\n")
    log(f"{dest} -> {runtime}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("--overlay", type=Path, help="make this folder a venv over the runtime and this checkout")
    ap.add_argument("--path-only", action="store_true", help="print where the runtime lives; build nothing")
    args = ap.parse_args()
    if args.path_only:
        print(runtime_dir(args.name))
        return
    target = build(args.name)
    if args.overlay:
        overlay(target, args.overlay.resolve() if not args.overlay.is_absolute() else args.overlay)
    print(target)


if __name__ == "__main__":
    main()
