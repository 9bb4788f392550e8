"""Views render a job's state; they never change it. There is always a text view."""
