"""`kvsp gateway`: an OpenAI-compatible front door in front of the PC (DESIGN §10).

`app` serves the API, `requests` checks its bodies, `text` tokenizes as the model does,
`scopes` picks the caller's scope, `backend` routes and generates, `responses` shapes the
answers and `errors` the refusals; `service` is the command.
"""
