"""The bottom layer of mldebug: records (Stop, Violation), break-on parsing, the session
(the mailbox engines post to), which frames are the user's, replay and quiet state,
errors. It imports torch and numpy at most, and nothing of mldebug above it."""
