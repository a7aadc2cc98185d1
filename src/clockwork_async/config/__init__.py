"""One config: the sections a user writes (`daemon`), their field rules (`fields`) and
the key helpers every layer validates with (`keys`)."""
