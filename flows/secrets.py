"""Secrets from Prefect Secret blocks, read inside the flow, so keys never travel as flow parameters.

A setting such as ROLLFLOW_BACKEND__API_KEY_BLOCK=openai-key names the block; a key set directly in the
environment (ROLLFLOW_BACKEND__API_KEY) wins over the block.
"""

from __future__ import annotations

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
