"""What the trainer writes next to the weight channel: the weight versions of every view (publisher.py)
and the checkpoints a run resumes from (checkpoint.py), both fenced by the channel's writer lease."""
