"""The OpenAI-compatible HTTP server over the engine's request loop (the serve extra:
pip install 'fuselab[serve]'). `fuselab serve MODEL`, or `build_app(llm, name)` from
fuselab.serve.app for any ASGI server."""
