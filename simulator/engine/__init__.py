"""The simpy ENGINE: arrivals, replicas stepping through batches, a router. Time lives here."""
