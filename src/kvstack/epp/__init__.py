"""The endpoint picker: Envoy's ext_proc service that names the engine for each OpenAI request."""
