"""The one-paragraph messages of a run that ended without publishing: what happened and what to do."""

from __future__ import annotations

from rollflow.settings import RunSpec
from rollflow.tasks.publish.audit import AuditSummary


def deadline_message(summary: AuditSummary, spec: RunSpec) -> str:
    return (
        f"The run stopped at its deadline ({spec.deadline_s:g}s) with {summary.chunks_committed} of "
        f"{summary.chunks_total} chunks committed; running chunks saved their finished rollouts. Nothing "
        f"was published. Run the same command again to resume where it stopped."
    )


def incomplete_message(summary: AuditSummary, spec: RunSpec, chunk_errors: list[str]) -> str:
    failed_chunks = (
        f" {len(chunk_errors)} chunk task(s) failed after their retries (first: {chunk_errors[0]})."
        if chunk_errors
        else ""
    )
    if summary.changed_chunks:
        failed_chunks += (
            f" The data of chunk {', '.join(map(str, summary.changed_chunks[:10]))} changed after it was "
            f"committed (it no longer matches its manifest's sha256); its commit was withdrawn, so the "
            f"next run collects it again."
        )
    if summary.lost_chunks:
        failed_chunks += (
            f" The data object of chunk {', '.join(map(str, summary.lost_chunks[:10]))} is gone while its "
            f"manifest remained (deleted from the output); its commit was withdrawn, so the next run "
            f"collects it again."
        )
    return (
        f"The dataset was not published: the audit found {summary.missing:,} of "
        f"{summary.rows_expected:,} rollouts missing ({summary.failed:,} failed after retries, listed "
        f"under {spec.output.rstrip('/')}/failures/), {summary.duplicates:,} duplicated and "
        f"{summary.invalid + summary.missing_reward:,} invalid or without a numeric reward. Everything "
        f"collected is committed: run the same command again to retry only what is missing, or pass "
        f"--allow-incomplete to publish what there is." + failed_chunks
    )
