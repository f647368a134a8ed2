"""Secrets from Prefect Secret blocks, read inside the flow, so keys never travel as flow parameters.

A setting such as ROLLFLOW_BACKEND__API_KEY_BLOCK=openai-key names the block; a key set directly in the
environment (ROLLFLOW_BACKEND__API_KEY) wins over the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from rollflow.settings import RollflowSettings

# (settings group, secret field): each field `f` may name a block in `f_block`.
SECRET_FIELDS = (("backend", "api_key"), ("storage", "access_key_id"), ("storage", "secret_access_key"))


class SecretBlockError(Exception):
    """A *_BLOCK setting names a Secret block that cannot be read; the message says how to create it."""


async def read_secret_block(name: str, setting: str) -> SecretStr:
    from prefect.blocks.system import Secret

    try:
        block = await Secret.aload(name)
    except (ValueError, KeyError) as exc:
        raise SecretBlockError(
            f"{setting} names the Prefect Secret block {name!r}, which this Prefect server does not have "
            f"({exc}). Create it in the UI (Blocks > Secret) or with "
            f"`Secret(value=...).save({name!r})`, or set the key in the environment instead."
        ) from None
    value = block.get()
    if not isinstance(value, str):
        raise SecretBlockError(f"{setting}: the Secret block {name!r} must hold a string, not a JSON value.")
    return SecretStr(value)


async def resolve_secret_blocks(settings: RollflowSettings) -> RollflowSettings:
    """`settings` with each unset (or empty) secret filled from the Secret block its *_block setting names."""
    groups: dict[str, dict[str, SecretStr]] = {}
    for group, field in SECRET_FIELDS:
        section = getattr(settings, group)
        block = getattr(section, f"{field}_block")
        current = getattr(section, field)
        if block and (current is None or not current.get_secret_value()):
            setting = f"ROLLFLOW_{group.upper()}__{field.upper()}_BLOCK"
            groups.setdefault(group, {})[field] = await read_secret_block(block, setting)
    if not groups:
        return settings
    return settings.model_copy(
        update={g: getattr(settings, g).model_copy(update=fields) for g, fields in groups.items()}
    )


@dataclass(frozen=True)
class WorkerSecrets:
    """resolve_secret_blocks for a Dask or Ray worker, which runs no Prefect task run and so has none of
    the flow's Prefect settings: the flow's API URL and key travel with it, as Prefect's own task runners
    send them with every task. Prefect is imported there only when a block is named."""

    api_url: str | None = None
    api_key: SecretStr | None = None

    async def __call__(self, settings: RollflowSettings) -> RollflowSettings:
        if not any(getattr(getattr(settings, g), f"{f}_block") for g, f in SECRET_FIELDS):
            return settings
        from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

        updates: dict[Any, Any] = {PREFECT_API_URL: self.api_url} if self.api_url else {}
        if self.api_key is not None:
            updates[PREFECT_API_KEY] = self.api_key.get_secret_value()
        with temporary_settings(updates=updates):
            return await resolve_secret_blocks(settings)


def worker_secrets() -> WorkerSecrets:
    """The flow's Prefect server, for workers that read Secret blocks."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    return WorkerSecrets(str(api.url) if api.url else None, api.key)
