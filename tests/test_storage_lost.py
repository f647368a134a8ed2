"""Storage that disappears mid-run is one storage-error paragraph that says what is lost."""

from __future__ import annotations

from cli_runs import run_args, spawn, wait_until

from rollflow.infra.local import spawn_simulator


def _delete_bucket(fs, bucket: str) -> None:
    """The run keeps committing while the bucket is emptied, so an object can land between the listing and
    the bucket's deletion (BucketNotEmpty): empty it again, a bounded number of times."""
    for _ in range(20):
        try:
            fs.rm(bucket, recursive=True)
            return
        except Exception as exc:  # s3fs wraps BucketNotEmpty in more than one way
            if "BucketNotEmpty" not in repr(exc) and "not empty" not in str(exc):
                raise
            fs.invalidate_cache()
    raise AssertionError(f"bucket {bucket} still not empty after 20 deletions")


def test_bucket_deleted_mid_run_is_one_paragraph_exit_2(cli_env, moto_s3, rows_input):
    sim = spawn_simulator("--latency-ms", "40", "--slots", "16")
    try:
        bucket = moto_s3.new_bucket()
        out, fs = f"s3://{bucket}/run", moto_s3.fs()

        def committed() -> bool:
            fs.invalidate_cache()
            try:
                return any(p.endswith(".json") for p in fs.find(f"{out}/chunks"))
            except FileNotFoundError:
                return False

        # The run finds its output gone when it next renews its lease, every third of the lease's lifetime:
        # 20 s by default, 2 s here (the renewal's budget, half the lifetime, stays far above a moto call).
        env = {**cli_env, **moto_s3.env, "ROLLFLOW_PIPELINE__LEASE_TTL_S": "6"}
        proc = spawn(run_args(rows_input, out, sim), env)
        wait_until(committed, proc)
        _delete_bucket(fs, bucket)
        _, err = proc.communicate(timeout=120)
        stderr = err.decode()
        assert proc.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        paragraphs = [line for line in stderr.splitlines() if line.startswith("rollflow:")]
        assert len(paragraphs) == 1, stderr[-3000:]
        message = paragraphs[0]
        assert bucket in message and "kept" not in message.replace("not kept", ""), message
    finally:
        sim.stop()
