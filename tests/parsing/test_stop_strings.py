"""Stop strings on streamed text: what is released, and where in the last feed a stop ends."""

from __future__ import annotations

from services.gateway.stop_strings import StopStringMatcher


def test_a_stop_string_spanning_feeds_ends_where_the_last_feed_completes_it() -> None:
    matcher = StopStringMatcher(["world"])
    first = matcher.feed("Hello wo")
    last = matcher.feed("rld. Bye")
    assert (first.text, first.stopped) == ("Hell", False)
    assert (last.text, last.stopped, last.stop_end) == ("o ", True, len("rld"))
    assert matcher.feed("more").text == "" and matcher.flush() == ""


def test_of_overlapping_stop_strings_the_one_ending_first_cuts_the_text() -> None:
    # As in vLLM, which checks as each token arrives: "cd" is complete before "bcde" is.
    check = StopStringMatcher(["bcde", "cd"]).feed("abcdef")
    assert (check.text, check.stopped, check.stop_end, check.stop) == ("ab", True, len("abcd"), "cd")


def test_a_stop_string_at_the_very_start_leaves_no_text() -> None:
    check = StopStringMatcher(["\n"]).feed("\nnext line")
    assert (check.text, check.stopped, check.stop_end) == ("", True, 1)


def test_text_held_back_for_a_possible_stop_is_released_at_the_end() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("all ST").text == "all"
    assert matcher.flush() == " ST"
