"""Secrets from Prefect Secret blocks: read by the flow, never a parameter; a missing block is explained."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import SecretStr

from rollflow.flows.secrets import SecretBlockError, resolve_secret_blocks
from rollflow.settings import RollflowSettings
from rollflow.settings.models import BackendSettings, StorageSettings


def test_secret_blocks_fill_unset_keys_and_env_keys_win(prefect_server) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def scenario() -> None:
        await Secret(value="sk-from-block").asave("rf-test-api-key", overwrite=True)
        await Secret(value="s3-secret-from-block").asave("rf-test-s3-secret", overwrite=True)
        settings = RollflowSettings(
            _env_file=None,
            backend=BackendSettings(api_key_block="rf-test-api-key"),
            storage=StorageSettings(secret_access_key_block="rf-test-s3-secret"),
        )
        resolved = await resolve_secret_blocks(settings)
        assert resolved.backend.api_key.get_secret_value() == "sk-from-block"
        assert resolved.storage.secret_access_key.get_secret_value() == "s3-secret-from-block"
        assert "sk-from-block" not in repr(resolved) and "sk-from-block" not in str(resolved.model_dump())
        assert settings.backend.api_key is None, "the original settings are left as they were"

        direct = settings.model_copy(
            update={"backend": BackendSettings(api_key=SecretStr("sk-env"), api_key_block="rf-test-api-key")}
        )
        assert (await resolve_secret_blocks(direct)).backend.api_key.get_secret_value() == "sk-env"

        missing = RollflowSettings(_env_file=None, backend=BackendSettings(api_key_block="rf-no-such-block"))
        with pytest.raises(SecretBlockError, match=r"ROLLFLOW_BACKEND__API_KEY_BLOCK.*rf-no-such-block"):
            await resolve_secret_blocks(missing)

    with temporary_settings({PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        asyncio.run(scenario())


def test_block_names_are_not_flow_parameters() -> None:
    params = BackendSettings(api_key=SecretStr("sk-x"), api_key_block="blk").params().model_dump()
    assert "api_key" not in params and "api_key_block" not in params
