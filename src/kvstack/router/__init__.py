"""The router: kvstack's own streaming OpenAI proxy in front of the engines (`kvstack router`)."""
