"""Storage that disappears mid-run is one storage-error paragraph that says what is lost."""

from __future__ import annotations

from cli_runs import run_args, spawn, wait_until

from rollflow.infra.local import spawn_simulator


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
        fs.rm(f"{bucket}", recursive=True)
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
