"""The OpenAI API as the simulated engine serves it: request fields, limits and validation like vLLM's."""
