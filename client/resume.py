"""Resuming a Generate stream the router dropped after it began (the router restarting, say).

Before any token, a failed try (UNAVAILABLE) is simply sent again. After tokens, sending it
again would repeat them; the SDK instead asks for the rest, as the router itself resumes a
stream a decode worker dropped (router/request_run.py): the prompt plus the tokens received,
as a new request (`<id>.resume<n>`: the old router may have left the id on a worker), for the
tokens still to come, with `output_offset` counting the received ones — seeded sampling draws
at the same positions and stop words match across the break (engine/stop.py). The caller sees
one stream under its own request id, and one result whose usage counts the original prompt.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc

from splitserve.client.prepared import PreparedRequest

log = logging.getLogger("splitserve.client")


def next_try(
    original: PreparedRequest, received: list[int], code: grpc.StatusCode, attempt: int, options
) -> PreparedRequest | None:
    """The request to send after try `attempt` failed with `code` having delivered `received`
    tokens (as the caller saw them), or None: the failure is the caller's (raise it)."""
    if code != grpc.StatusCode.UNAVAILABLE or attempt >= options.max_attempts:
        return None
    if not received:
        return original
    if not options.resume_streams:
        return None
    params = original.params
    remaining = params.num_tokens_to_generate - len(received)
    if remaining < 1:  # every token came, only the finish was lost: asking for none is refused
        return None
    resumed = dataclasses.replace(params, num_tokens_to_generate=remaining,
                                  output_offset=params.output_offset + len(received),
                                  return_prompt_log_probs=False)  # they came with the first token
    request_id = f"{original.request_id}.resume{attempt}"
    log.info("%s: the router's stream broke after %d tokens (%s); resuming as %s", original.request_id, len(received),
             code.name, request_id)
    return PreparedRequest(request_id, [*original.token_ids, *received], resumed)
