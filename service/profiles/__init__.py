"""Profiles: ``/v1/profiles`` (``routes``), its paged summaries (``summaries``) and the listing
query both read (``listing``)."""
