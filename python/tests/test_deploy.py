"""The deployment files as their own tools check them: the Kubernetes manifests against the
Kubernetes schemas (kubernetes-validate, strict), and every shell script (the Slurm recipe,
the package's maintainer scripts, the setup and test scripts) with shellcheck."""

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_kubernetes_manifests_validate_against_the_schemas():
    pytest.importorskip("kubernetes_validate")
    manifests = sorted(str(p) for p in (REPO / "deploy" / "k8s").glob("*.yaml"))
    assert manifests
    tool = pathlib.Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(tool), "--strict", *manifests], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for kind in ("daemonset/larderd", "service/larderd", "configmap/larder-config"):
        assert f"passed for resource {kind}" in out.stdout + out.stderr, kind


def test_the_shell_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup installs it)")
    scripts = [REPO / p for p in ("scripts/setup", "scripts/test", "scripts/package", "scripts/test-package",
                                  "deploy/install.sh", "deploy/debian/postinst", "deploy/debian/prerm",
                                  "deploy/debian/postrm", ".ci/run")]
    scripts += sorted((REPO / "deploy" / "slurm").iterdir())
    out = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
