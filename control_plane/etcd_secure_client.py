"""`SecureClient`: aetcd 1.0's Client with what it lacks for a secured etcd — a TLS channel, and a
new auth token after etcd forgot the old one.

aetcd authenticates once, on connect. etcd keeps (simple) tokens in memory, so after an etcd restart
every call fails with "invalid auth token" for good. Here a call failing with UnauthenticatedError
marks the token stale, and the next call (callers retry on aetcd.ClientError) authenticates again on
the same channel. `connect` otherwise follows aetcd.Client.connect line for line.
"""

from __future__ import annotations

import asyncio
import functools
import inspect

import aetcd
import grpc
from aetcd import exceptions as etcd_exceptions
from aetcd import rpc, watcher


class SecureClient(aetcd.Client):
    def __init__(self, credentials: grpc.ChannelCredentials | None = None, **kwargs) -> None:
        """`credentials`: TLS to etcd; None = plaintext. Other arguments as aetcd.Client's."""
        super().__init__(**kwargs)
        self._credentials = credentials
        self._is_token_stale = False

    async def connect(self) -> None:
        try:
            if self._connected.is_set():
                if self._is_token_stale:
                    await self._authenticate()
                return
            await self._connect()
        except rpc.AioRpcError as e:
            etcd_exceptions._handle_exception(e)

    async def _authenticate(self) -> None:
        self._is_token_stale = False
        if self._username is None or self._password is None:
            return
        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
        reply = await rpc.AuthStub(self.channel).Authenticate(request, timeout=self._timeout)
        self.metadata = (("token", reply.token),)
        if self._watcher is not None:
            self._watcher._metadata = self.metadata  # watch streams opened from now on

    async def _connect(self) -> None:
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = self._options.items()
            if self._credentials is None:
                self.channel = rpc.insecure_channel(target, options=options)
            else:
                self.channel = rpc.secure_channel(target, self._credentials, options=options)
            await self._authenticate()
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def _marks_stale_token(method):
    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except etcd_exceptions.UnauthenticatedError:
            self._is_token_stale = True
            raise

    return call


for _name, _method in inspect.getmembers(aetcd.Client, inspect.iscoroutinefunction):
    if not _name.startswith("_") and _name not in ("connect", "close"):
        setattr(SecureClient, _name, _marks_stale_token(_method))
