"""API dialects: Anthropic Messages, OpenAI Chat Completions, OpenAI Responses (pure: JSON in, JSON/SSE out)."""
