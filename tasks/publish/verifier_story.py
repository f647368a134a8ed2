"""What scored a run's rows, for report.json: the verifier, its library's version and its settings, so a
reader can tell two datasets scored differently apart (a collection's `story.scored_by`, a reverify's
`verifier`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from rollflow.settings import VerifySettings, redact

LIBRARIES = {"math": "math-verify"}  # verifier -> the package whose version decides its rewards


def verifier_story(verify: VerifySettings, scored: bool = True) -> dict[str, Any] | None:
    """The verifier, its library's version (math-verify's for `math`) and the settings it ran with; None
    when the backend gave the rewards (an agent)."""
    if not scored:
        return None
    name = verify.verifier_for("responses")  # an agent's replies are scored only by a verifier set
    library = LIBRARIES.get(name)
    try:
        library_version = version(library) if library else None
    except PackageNotFoundError:
        library_version = None
    return {
        "name": name,
        "url": redact.redact(verify.url) if name == "http" and verify.url else None,
        "library": library,
        "library_version": library_version,
        "correct_threshold": verify.correct_threshold,
        "check_timeout_s": verify.check_timeout_s,
        "processes": verify.processes,
    }
