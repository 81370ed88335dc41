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


def test_the_daemonset_starts_larderd_as_the_start_the_root_tests_run():
    """tests/access.rs (`the_daemonsets_start_as_root_...`) runs larderd as a container runtime
    starts this manifest: root, only CAP_SETUID and CAP_SETGID, no privilege escalation,
    `--user larder`. This keeps the manifest to that start."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "daemonset.yaml").read_text()))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (larderd,) = pod["containers"]
    assert larderd["command"][-2:] == ["--user", "larder"], larderd["command"]
    sc = larderd["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}
    # The hostPath folders are given to larder by an init container that may only chown.
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/run/larder", "/var/cache/larder", "/var/lib/larder"}


def test_the_shell_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup installs it)")
    scripts = [REPO / p for p in ("scripts/setup", "scripts/test", "scripts/package", "scripts/test-package", "scripts/test-systemd", "scripts/test-image",
                                  "deploy/install.sh", "deploy/debian/postinst", "deploy/debian/prerm",
                                  "deploy/debian/postrm", ".ci/run")]
    scripts += sorted((REPO / "deploy" / "slurm").iterdir())
    out = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
