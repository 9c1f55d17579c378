"""Installing like a library: a wheel built from the tree holds every module and the replayer's
source, and installed alone (no source tree on the path) it imports, computes and runs its command
line; `python -m dwconv build` builds the C++ launch path or says why not."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*command, cwd, env=None):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    return done.stdout


def test_wheel_installs_and_works(tmp_path):
    import zipfile

    source = tmp_path / "source"  # (a copy: building in the tree would leave build/ there)
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source)
    shutil.copytree(os.path.join(ROOT, "src"), source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
        str(source), cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").iterdir()
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "src"))
                for folder, _, files in os.walk(os.path.join(ROOT, "src", "dwconv")) for name in files
                if name.endswith((".py", ".cpp"))}
    assert packaged <= names, packaged - names
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"), str(wheel),
        cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = run(sys.executable, "-c", "import dwconv, torch, torch.nn.functional as F; "
              "x, w = torch.randn(2, 3, 8, 8), torch.randn(3, 1, 3, 3); "
              "assert torch.allclose(dwconv.depthwise_conv2d(x, w, padding=1), F.conv2d(x, w, padding=1, groups=3)); "
              "print(dwconv.__file__)", cwd=tmp_path, env=env)
    assert out.strip().startswith(str(tmp_path / "site"))
    assert "python -m dwconv build" in run(sys.executable, "-m", "dwconv", "--help", cwd=tmp_path, env=env)


def test_build_command(capsys):
    """Builds (or finds) the replayer of this machine; where it cannot be built, says why and fails."""
    from dwconv.__main__ import main
    from dwconv.replay import native

    try:
        native.extension()
        buildable = True
    except native.BuildFailed:
        buildable = False
    assert main(["build"]) == (0 if buildable else 1)
    captured = capsys.readouterr()
    assert ("C++ launch path" in captured.out) if buildable else ("could not be built" in captured.err)
