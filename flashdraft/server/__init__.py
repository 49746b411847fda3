"""llama-server-compatible HTTP server (``flashdraft serve``).

Modules: ``cli`` (flags, start-up), ``app`` (app factory, auth, info routes),
``completions`` (generation routes, streaming), ``state`` (settings, loading status,
request checks), ``schemas`` (request models), ``prompting`` (request -> prompt token ids),
``scheduler`` (the one worker thread that owns the generator), ``responses`` (OpenAI /
llama-server response shapes), ``metrics`` (Prometheus counters) and ``errors``
(OpenAI's error shape).
"""
