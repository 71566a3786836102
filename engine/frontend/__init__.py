"""The serving side of the engine, wherever its core runs: prompts to token ids
(input_processor), token ids to streamed text (output_processor, detokenizer), and the callers'
streams (request_streams)."""
