"""The Transcriber stage: streamed speech -> speech events and transcript segments (Whisper on
CTranslate2, Silero VAD on ONNX Runtime; `stagemesh.models.families.whisper`). Its builder is
`servicer.build_stage` (services/registry.py)."""
