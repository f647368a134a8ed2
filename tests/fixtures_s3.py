"""An S3-compatible store (moto_server) on 127.0.0.1 for the session, reached through s3fs."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import s3fs

from rollflow.infra.local import Service, spawn_moto


@dataclass
class S3:
    service: Service

    @property
    def endpoint(self) -> str:
        return self.service.url

    @property
    def env(self) -> dict[str, str]:
        return self.service.env

    def fs(self) -> s3fs.S3FileSystem:
        return s3fs.S3FileSystem(skip_instance_cache=True)

    def new_bucket(self) -> str:
        name = f"rf-{secrets.token_hex(4)}"
        self.fs().mkdir(name)
        return name


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3]:
    service = spawn_moto()
    saved = {k: os.environ.get(k) for k in service.env}
    os.environ.update(service.env)
    yield S3(service)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    service.stop()
