"""A Python client for a trainer's side of rollouts (docs/capture.md), over the admin API.

::

    from codebuddy2api.client import Rollouts
    import openai

    with Rollouts("http://127.0.0.1:8080", admin_token) as rollouts:
        agent = openai.OpenAI(base_url=rollouts.base_url_for("job42.ep7:env3"), api_key=client_key)
        ...  # the harness runs its episode through `agent`
        snapshot = rollouts.freeze("job42.ep7:env3")
        rollouts.reward("job42.ep7:env3", 1.0, details={"tests_passed": 3})
        for sample in rollouts.export(group="job42.step7", frozen=True, shape="verifiers"):
            add_sample(sample["prompt_ids"], sample["completion_ids"], sample["completion_mask"], ...)

Only httpx is needed. Every method raises :class:`RolloutsError` for an error answer (its
``status``, ``code`` and ``message``). :meth:`Rollouts.export` yields whole rollouts' lines
and resumes after the last whole rollout when the stream breaks (``resume`` times);
:meth:`Rollouts.export_parquet` downloads the same records as one Parquet file (the
server needs the ``parquet`` extra; reading the file needs pyarrow, or any Parquet reader).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypedDict

import httpx

__all__ = ["AbortAnswer", "EngineAbort", "RewardAnswer", "Rollouts", "RolloutsError", "Segment", "Shape", "Snapshot", "Trajectory"]

Shape = Literal["native", "nemo-gym", "trl", "verifiers"]
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Segment(TypedDict):
    """A chain of calls each extending the previous token for token."""

    call_ids: list[str]
    tokens: list[int]
    mask: list[int]
    logprobs: list[float | None]


class Trajectory(TypedDict):
    rollout_id: str
    segments: list[Segment]


class RewardView(TypedDict):
    reward: float
    details: dict[str, Any] | None
    at: float


class Snapshot(TypedDict):
    """``GET /admin/api/rollouts/R``: the rollout's state and its call records in order."""

    rollout_id: str
    complete: bool
    incomplete: list[str]
    frozen: bool
    calls: list[dict[str, Any]]
    group_id: str | None
    reward: RewardView | None
    call_rewards: dict[str, RewardView]


class EngineAbort(TypedDict, total=False):
    """One engine told through ``/abort_requests``: ``error`` when not ``ok``."""

    upstream: str
    ok: bool
    error: str


class AbortAnswer(Snapshot):
    aborted: list[str]
    engine_abort: list[EngineAbort]


class RewardAnswer(TypedDict):
    rollout_id: str
    call_id: str | None
    reward: float
    details: dict[str, Any] | None
    at: float


class RolloutsError(Exception):
    """An error answer of the admin API (or a broken export that could not resume)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


def _check(rollout_id: str) -> str:
    if not _VALID.fullmatch(rollout_id):
        raise ValueError(f"invalid rollout id {rollout_id!r}: 1-128 characters of A-Z a-z 0-9 . _ : -")
    return rollout_id


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    response.read()
    try:
        error = response.json()["error"]
        raise RolloutsError(response.status_code, str(error.get("code")), str(error.get("message")))
    except (ValueError, KeyError, TypeError):
        raise RolloutsError(response.status_code, "http_error", response.text[:200]) from None


class Rollouts:
    """The admin API's rollout routes, for one gateway (``base_url``, e.g.
    ``http://127.0.0.1:8080``) and its admin token. ``transport`` is httpx's (tests)."""

    def __init__(self, base_url: str, admin_token: str, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url + "/admin/api", timeout=timeout, transport=transport,
                                  headers={"authorization": f"Bearer {admin_token}"}, trust_env=False)

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def base_url_for(self, rollout_id: str, api: Literal["openai", "anthropic"] = "openai") -> str:
        """The base URL a harness uses for this rollout: ``.../rollouts/R/v1`` for the
        OpenAI SDK and Codex, ``.../rollouts/R`` for the Anthropic SDK and Claude Code."""
        root = f"{self.base_url}/rollouts/{_check(rollout_id)}"
        return root + "/v1" if api == "openai" else root

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        response = self._http.request(method, path, json=body, params={k: v for k, v in params.items() if v is not None})
        _raise_for(response)
        return response.json() if response.status_code != 204 else None

    def list_rollouts(self, since: float | None = None, group: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Rollouts updated at or after ``since`` (of ``group``), most recent first."""
        return self._json("GET", "/rollouts", since=since, group=group, limit=limit)["rollouts"]  # type: ignore[no-any-return]

    def read(self, rollout_id: str) -> Snapshot:
        return self._json("GET", f"/rollouts/{_check(rollout_id)}")  # type: ignore[no-any-return]

    def trajectory(self, rollout_id: str) -> Trajectory:
        return self._json("GET", f"/rollouts/{_check(rollout_id)}/trajectory")  # type: ignore[no-any-return]

    def reward(self, rollout_id: str, reward: float, *, details: dict[str, Any] | None = None,
               call_id: str | None = None) -> RewardAnswer:
        """The rollout's reward, or one call's; posting again replaces it (idempotent).
        A reward that is not a finite number is a ValueError here (JSON has no such number)."""
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        body: dict[str, Any] = {"reward": reward}
        if details is not None:
            body["details"] = details
        if call_id is not None:
            body["call_id"] = call_id
        return self._json("POST", f"/rollouts/{_check(rollout_id)}/reward", body)  # type: ignore[no-any-return]

    def group(self, rollout_id: str, group_id: str) -> dict[str, str]:
        return self._json("POST", f"/rollouts/{_check(rollout_id)}/group", {"group_id": group_id})  # type: ignore[no-any-return]

    def freeze(self, rollout_id: str) -> Snapshot:
        """Later calls of the rollout are refused (409); the final snapshot."""
        return self._json("POST", f"/rollouts/{_check(rollout_id)}/freeze", {})  # type: ignore[no-any-return]

    def abort(self, rollout_id: str) -> AbortAnswer:
        """Freeze the rollout and end its calls running in that gateway (they get
        ``rollout_aborted`` and are recorded ``cancelled``; engines with an engine API get
        ``/abort_requests``); the snapshot, their ids and ``engine_abort`` (one entry per engine told)."""
        return self._json("POST", f"/rollouts/{_check(rollout_id)}/abort", {})  # type: ignore[no-any-return]

    def delete(self, rollout_id: str) -> None:
        """Only a frozen rollout (else RolloutsError ``rollout_not_frozen``)."""
        self._json("DELETE", f"/rollouts/{_check(rollout_id)}", {})

    def export(self, *, since: float | None = None, until: float | None = None, group: str | None = None,
               frozen: bool | None = None, shape: Shape = "native", cursor: str | None = None,
               resume: int = 3) -> Iterator[dict[str, Any]]:
        """The bulk export's lines, a whole rollout at a time (one line for ``native``, one
        per segment otherwise). A stream that breaks, or ends with the server's error line,
        is resumed after the last whole rollout, up to ``resume`` times in a row."""
        params = {"since": since, "until": until, "group": group, "shape": shape,
                  "frozen": None if frozen is None else ("true" if frozen else "false")}
        attempts = 0
        while True:
            try:
                for rollout in self._export_once(params, cursor):
                    yield from rollout
                    cursor, attempts = rollout[-1]["cursor"], 0
                return
            except (httpx.TransportError, _Broken) as exc:
                attempts += 1
                if attempts > resume:
                    if isinstance(exc, _Broken):
                        raise RolloutsError(503, exc.code, exc.message) from None
                    raise

    def export_parquet(self, path: str | os.PathLike[str], *, since: float | None = None, until: float | None = None,
                       group: str | None = None, frozen: bool | None = None, shape: Shape = "native",
                       cursor: str | None = None, read_timeout: float | None = 600.0) -> Path:
        """The bulk export's records as one Parquet file at ``path`` (one row per record of
        :meth:`export`, one row group per page of rollouts); its ``path``. The file appears
        only whole: it is written beside ``path`` and renamed. The server sends its first
        byte once the whole file is built: ``read_timeout`` (seconds, None: no limit) bounds
        that wait. To resume a later export after it, pass the last row's ``cursor``. A
        server without pyarrow answers RolloutsError ``parquet_unavailable``."""
        target = Path(path)
        params = {"since": since, "until": until, "group": group, "shape": shape, "cursor": cursor, "format": "parquet",
                  "frozen": None if frozen is None else ("true" if frozen else "false")}
        partial = target.with_name(target.name + ".part")
        try:
            timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout)
            with self._http.stream("GET", "/rollouts/export", params={k: v for k, v in params.items() if v is not None},
                                   timeout=timeout) as response:
                _raise_for(response)
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def _export_once(self, params: dict[str, Any], cursor: str | None) -> Iterator[list[dict[str, Any]]]:
        query = {k: v for k, v in {**params, "cursor": cursor}.items() if v is not None}
        with self._http.stream("GET", "/rollouts/export", params=query) as response:
            _raise_for(response)
            pending: list[dict[str, Any]] = []
            for text in response.iter_lines():
                if not text:
                    continue
                line = json.loads(text)
                if "error" in line:
                    raise _Broken(str(line["error"].get("code")), str(line["error"].get("message")))
                pending.append(line)
                if "segment" not in line or line["segment"] == line["segment_count"] - 1:
                    yield pending
                    pending = []


class _Broken(Exception):
    """The server ended the export with an error line (it may be resumed)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message
