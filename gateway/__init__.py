"""splitserve.gateway: the OpenAI-compatible HTTP front door (`splitserve gateway`).

It validates requests, applies chat templates and tokenizes, sends token ids to a
router over gRPC (through splitserve.client.AsyncClient), detokenizes the streamed
tokens, parses tool calls and reasoning, and answers in OpenAI's shapes. app.py
lists the routes; requests.py and http_body.py the validation; completions.py and
chat.py the two generation endpoints. It never imports torch.
"""
