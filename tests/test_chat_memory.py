"""The chat page's memory strip (ui/chat_memory.py): this chat's blocks counted from a block map
as shared (holding the preset system prompt), its own, and swapped to the host; and its HTML."""
from engine import BlockInfo, BlockMap, BlockState
from ui.chat_memory import ChatMemory, chat_memory, strip_html


def used(block_id: int, *owners: str, preset: bool = False) -> BlockInfo:
    return BlockInfo(block_id, BlockState.USED, len(owners), 16, None, owners, preset)


def cached(block_id: int) -> BlockInfo:
    return BlockInfo(block_id, BlockState.CACHED, 0, 16, 123, ())


def test_a_preset_chat_alone_counts_its_preset_blocks_as_shared():
    device = (used(0, "chat7/2", preset=True), used(1, "chat7/2"), used(2, "chat7/2"), cached(3))
    assert chat_memory(BlockMap(16, device, ()), {"chat7"}) == ChatMemory(1, 2, 0, 16)


def test_blocks_held_with_another_chat_are_shared_only_when_they_hold_the_preset():
    device = (used(0, "chat7/2", "chat9/1", preset=True), used(1, "chat7/2", "chat9/1", preset=True),
              used(2, "chat7/2", "chat7/2#1"),  # a forked sample's blocks: held twice, still its own
              used(3, "chat9/1"), used(4, "chat7/2"))
    host = (used(0, "chat7/2", preset=True), used(1, "chat7/2"), used(2, "chat9/1"))
    assert chat_memory(BlockMap(16, device, host), {"chat7"}) == ChatMemory(2, 2, 2, 16)
    assert chat_memory(BlockMap(16, device, host), {"chat9"}) == ChatMemory(2, 1, 1, 16)


def test_a_new_chats_first_reply_counts_under_its_own_key():
    device = (used(0, "chat-new-ab12/1", preset=True), used(1, "chat-new-ab12/1"), used(2, "chat4/1"))
    assert chat_memory(BlockMap(16, device, ()), {"chat4", "chat-new-ab12"}) == ChatMemory(1, 2, 0, 16)


def test_the_strip_names_the_preset_only_when_it_holds_some_of_it():
    page = strip_html(ChatMemory(1, 5, 2, 16), "chat7")
    assert 'data-shared="1" data-own="5" data-host="2"' in page
    assert "1 shared (the preset system prompt, the same blocks for every chat on it) · 5 its own · 2 swapped" in page
    assert page.count("pc-kv-shared") == 1 and page.count("pc-kv-own") == 5 and page.count("pc-kv-host") == 2
    assert 'href="panel?chat=chat7"' in page
    custom = strip_html(ChatMemory(0, 3, 0, 16), "chat8")  # a custom system prompt shares nothing
    assert 'data-shared="0"' in custom and "shared" not in custom.split(">", 1)[1]
    assert "3 its own · 0 swapped to the host" in custom
