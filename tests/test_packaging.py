"""The package installs next to the torch (and Triton) a user already has.

A wheel is built from the working tree (without the optional C++ extension), then pip
resolves it, offline (--no-index, this machine's pip configuration switched off), into
fresh virtualenvs: one that holds the torch 2.11 + Triton 3.6 of a common CUDA image
(as installed metadata), one that holds this machine's real CPU torch and no Triton.
pip must install the package alone, never replace torch; the package must import
without Triton, which then reports itself unavailable."""

import email
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# trainer/ and bench/ too, as a checkout has them: the wheel must leave them out.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "hadw_kernels", "trainer", "bench")


def pip(*arguments, cwd=None) -> subprocess.CompletedProcess:
    """This interpreter's pip, hermetic: no configuration files, no PIP_* variables."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    environment.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", HADW_BUILD_CPP="0")
    return subprocess.run([sys.executable, "-m", "pip", *arguments], env=environment, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The package's wheel, built from a copy of the sources (the build writes into them)."""
    work = tmp_path_factory.mktemp("packaging")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            ignored = shutil.ignore_patterns("__pycache__", "*.so", "results")
            shutil.copytree(source, work / "src" / name, ignore=ignored)
        else:
            (work / "src").mkdir(exist_ok=True)
            shutil.copy(source, work / "src" / name)
    result = pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(work / "wheels"),
                 str(work / "src"))
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = (work / "wheels").glob("hadw_kernels-*.whl")
    return built


def fresh_venv(path: Path) -> Path:
    """A virtualenv without pip (the caller's pip drives it through --python)."""
    venv.EnvBuilder(with_pip=False).create(path)
    return path / "bin" / "python"


def site_packages(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def dry_run(python: Path, wheel: Path, requirement: str, report: Path) -> subprocess.CompletedProcess:
    return pip("--python", str(python), "install", "--dry-run", "--no-index", "--find-links", str(wheel.parent),
               "--report", str(report), requirement)


def installed_by(report: Path) -> dict[str, str]:
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}


def test_wheel_declares_ranges_license_types_and_the_verl_plugin(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = email.message_from_string(archive.read(metadata_name).decode())
        (entry_points_name,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        entry_points = archive.read(entry_points_name).decode()
    assert "hadw_kernels/py.typed" in names
    # The library alone: the trainer and the benchmarks, in the sources it was built from,
    # run from the checkout, so no generic top-level name (`trainer`) reaches site-packages.
    assert {name.split("/")[0] for name in names} == {"hadw_kernels", "hadw_kernels-0.2.0.dist-info"}
    assert any(re.search(r"\.dist-info/licenses/LICENSE$", name) for name in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist")]
    runtime = {r.name: r for r in requirements if r.marker is None}
    assert set(runtime) == {"torch", "numpy"}
    assert runtime["torch"].specifier.contains("2.11.0+cu130") and not runtime["torch"].specifier.contains("2.10.0")
    triton = [r for r in requirements if r.name == "triton"]
    assert triton and all(r.marker is not None and "extra" in str(r.marker) for r in triton)
    assert "[verl.plugins]\nhadw = hadw_kernels.integrations.verl" in entry_points


def fake_distribution(site: Path, name: str, version: str) -> None:
    """Installed-package metadata, all pip reads when it decides what to keep."""
    dist_info = site / f"{name}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")


def test_pip_keeps_the_torch_and_triton_of_a_cuda_image(wheel, tmp_path):
    python = fresh_venv(tmp_path / "cuda-image")
    site = site_packages(python)
    for name, version in (("torch", "2.11.0+cu130"), ("triton", "3.6.0"), ("numpy", "2.1.2")):
        fake_distribution(site, name, version)
    result = dry_run(python, wheel, "hadw-kernels[triton]", tmp_path / "report.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert installed_by(tmp_path / "report.json") == {"hadw-kernels": "0.2.0"}

    # Below the oldest supported torch pip would have to replace it (and, offline, cannot).
    older = fresh_venv(tmp_path / "older-image")
    for name, version in (("torch", "2.10.0+cu128"), ("numpy", "2.1.2")):
        fake_distribution(site_packages(older), name, version)
    result = dry_run(older, wheel, "hadw-kernels", tmp_path / "older.json")
    assert result.returncode != 0 and "torch>=2.11" in result.stderr


def link_distribution(name: str, target: Path, seen: set[str]) -> None:
    """Symlinks an installed distribution of this interpreter, and those it requires,
    into ``target``: its top-level packages and its .dist-info."""
    distribution = importlib.metadata.distribution(name)
    key = distribution.metadata["Name"].lower()
    if key in seen:
        return
    seen.add(key)
    base = Path(distribution.locate_file(""))
    for top in {Path(str(file)).parts[0] for file in distribution.files or []}:
        if top != ".." and not (target / top).exists() and (base / top).exists():
            (target / top).symlink_to(base / top)
    for text in distribution.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            link_distribution(requirement.name, target, seen)


@pytest.mark.slow
def test_package_installs_beside_a_real_torch_and_imports_without_triton(wheel, tmp_path):
    python = fresh_venv(tmp_path / "cpu")
    present = tmp_path / "present"
    present.mkdir()
    for name in ("torch", "numpy"):
        link_distribution(name, present, set())
    assert not (present / "triton").exists()
    (site_packages(python) / "present.pth").write_text(f"{present}\n")

    result = dry_run(python, wheel, "hadw-kernels", tmp_path / "report.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert installed_by(tmp_path / "report.json") == {"hadw-kernels": "0.2.0"}

    result = pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    assert result.returncode == 0, result.stderr[-3000:]
    # What pip put in site-packages: the library and its metadata, no `trainer`.
    installed = {path.name for path in site_packages(python).iterdir()} - {"present.pth"}
    assert {name for name in installed if not name.startswith("_")} == {"hadw_kernels", "hadw_kernels-0.2.0.dist-info"}
    probe = (
        "import importlib.util, hadw_kernels\n"
        "from hadw_kernels.backends import load_backend, BackendUnavailable\n"
        "assert importlib.util.find_spec('triton') is None\n"
        "print(hadw_kernels.__file__)\n"
        "print(hadw_kernels.available_backends())\n"
        "try:\n"
        "    load_backend('triton')\n"
        "except BackendUnavailable as error:\n"
        "    print(error)\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    location, backends, reason = result.stdout.strip().splitlines()
    assert Path(location).is_relative_to(site_packages(python))
    assert "triton" not in backends and "torch" in backends
    assert "triton" in reason and "not available" in reason


def test_integration_extras_are_the_ranges_the_integrations_check():
    # One range per peer: pyproject.toml's extras and integrations/versions.py agree;
    # exact pins live in constraints/cpu-py311.txt only, inside the range.
    import tomllib
    from packaging.version import Version

    from hadw_kernels.integrations.versions import SUPPORTED

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = dict(line.split("==") for line in (ROOT / "constraints" / "cpu-py311.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package, supported in SUPPORTED.items():
        (requirement,) = [Requirement(text) for text in extras[package] if Requirement(text).name == package]
        assert requirement.specifier == Requirement(f"{package}{supported}").specifier
        assert not any(spec.operator == "==" for spec in requirement.specifier), requirement
        assert requirement.specifier.contains(Version(pins[package]))


@pytest.mark.parametrize(("package", "version"), [("trl", "1.14.2"), ("trl", "1.17.0"), ("verl", "0.9.0"),
                                                  ("verl", "0.10.0")])
def test_integration_import_refuses_a_release_outside_its_range(package, version):
    # The check runs before the peer is imported, so this child process never loads it.
    code = (
        "import importlib.metadata as metadata\n"
        "real = metadata.version\n"
        f"metadata.version = lambda name: {version!r} if name == {package!r} else real(name)\n"
        f"import hadw_kernels.integrations.{package}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    from hadw_kernels.integrations.versions import SUPPORTED

    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: hadw_kernels.integrations.")
    assert f"supports {package}{SUPPORTED[package]}, found {package} {version}" in message


@pytest.mark.parametrize(("package", "version", "supported"), [
    ("trl", "1.15.0", True), ("trl", "1.16.0", True), ("trl", "1.16.1", True), ("trl", "1.14.2", False),
    ("verl", "0.9.1", True), ("verl", "0.9.2", True), ("verl", "0.9.0", False), ("verl", "0.8.0", False),
])
def test_supported_ranges(monkeypatch, package, version, supported):
    from hadw_kernels.integrations import versions

    monkeypatch.setattr(versions.importlib.metadata, "version", lambda name: version)
    if supported:
        assert versions.require_supported(package) == version
    else:
        with pytest.raises(ImportError, match=rf"supports {package}{re.escape(versions.SUPPORTED[package])}"):
            versions.require_supported(package)


def documented_pip_check_exceptions() -> set[tuple[str, str]]:
    """(package, requirement) pairs of docs/packaging.md's "What pip check reports" table."""
    text = (ROOT / "docs" / "packaging.md").read_text()
    section = text.split("### What `pip check` reports there", 1)[1].split("\n## ", 1)[0]
    pairs = set()
    for row in re.findall(r"^\| ([\w.-]+) \| (.+?) \| .+ \|$", section, re.M):
        package, requirements = row
        pairs.update((package.lower(), name.lower()) for name in re.findall(r"`([\w.-]+)`", requirements))
    return pairs


def test_pip_check_reports_only_what_packaging_md_explains():
    """Every unmet requirement pip check finds in this environment is one the docs list
    with its reason; a new one (a dependency dropped or a conflict introduced) fails."""
    documented = documented_pip_check_exceptions()
    assert ("verl", "transformers") in documented and len(documented) >= 10
    result = pip("check")
    found = set()
    for line in result.stdout.splitlines():
        missing = re.match(r"([\w.-]+) \S+ requires ([\w.-]+), which is not installed\.$", line)
        conflict = re.match(r"([\w.-]+) \S+ has requirement ([\w.-]+)\W.*, but you have ", line)
        match = missing or conflict
        assert match, f"pip check printed a line of another form: {line!r}"
        found.add((match.group(1).lower(), match.group(2).lower()))
    assert found <= documented, sorted(found - documented)
    assert (result.returncode == 0) == (not found)
