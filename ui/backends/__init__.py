"""What writes the chat's replies: the in-process engine or remote OpenAI-compatible servers,
behind one small interface (`ChatBackend`), and what the panel reads of them."""
