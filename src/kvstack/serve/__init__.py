"""`kvstack serve`: an OpenAI-compatible server whose KV memory budget, measured in bytes off the
caches' tensors, decides how many requests run at once (`admission`), stepping every running
request one token per iteration (`engine`), over HTTP (`app`)."""
