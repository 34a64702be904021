//! Long text into sentence groups (SPEC.md "long text"): split after `. ! ?` and their CJK
//! forms (closing quotes and brackets stay with their sentence; an ellipsis is a pause, not an
//! end), then group sentences up to `chunk_length` UTF-8 bytes. Speaker tags carry forward.

use crate::prompt::leading_speaker;

const ENDS: &[char] = &['.', '!', '?', '。', '！', '？'];
const CLOSERS: &[char] = &['"', '\'', '”', '’', ')', ']', '」', '』', '）'];

/// Sentences of `text`, each with its trailing punctuation and closers, whitespace trimmed.
pub fn sentences(text: &str) -> Vec<String> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut out = Vec::new();
    let mut start = 0usize;
    let mut i = 0usize;
    while i < chars.len() {
        let (_, c) = chars[i];
        if ENDS.contains(&c) {
            // An ellipsis ("..." or "…") is a pause.
            let next = chars.get(i + 1).map(|x| x.1);
            let prev = if i > 0 { Some(chars[i - 1].1) } else { None };
            if c == '.' && (next == Some('.') || prev == Some('.')) {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < chars.len() && (ENDS.contains(&chars[j].1) || CLOSERS.contains(&chars[j].1)) {
                j += 1;
            }
            // A Latin end needs whitespace (or the end) after it: "3.14" and "e.g" stay whole.
            let cjk = matches!(c, '。' | '！' | '？');
            if cjk || j >= chars.len() || chars[j].1.is_whitespace() {
                let end = chars.get(j).map(|x| x.0).unwrap_or(text.len());
                let s = text[start..end].trim();
                if !s.is_empty() {
                    out.push(s.to_string());
                }
                start = end;
            }
            i = j;
            continue;
        }
        i += 1;
    }
    let rest = text[start..].trim();
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// Sentence groups of at most `chunk_bytes` each (a longer sentence stands alone), every group
/// starting with the speaker tag in force.
pub fn segments(text: &str, chunk_bytes: usize) -> Vec<String> {
    let mut groups: Vec<String> = Vec::new();
    let mut speaker: Option<String> = None;
    let mut cur = String::new();
    let mut cur_speaker: Option<String> = None;
    for s in sentences(text) {
        let own = leading_speaker(&s).map(str::to_string);
        let changes = own.is_some() && own != cur_speaker;
        if !cur.is_empty() && (changes || cur.len() + 1 + s.len() > chunk_bytes) {
            groups.push(std::mem::take(&mut cur));
        }
        // The speaker in force after this sentence: its last tag, wherever it stands.
        let last = s
            .rfind("<|speaker:")
            .and_then(|i| s[i..].find("|>").map(|e| s[i..i + e + 2].to_string()));
        if cur.is_empty() {
            if let Some(tag) = &own {
                speaker = Some(tag.clone());
            }
            cur_speaker = speaker.clone();
            if own.is_none() {
                if let Some(tag) = &speaker {
                    cur.push_str(tag);
                    cur.push(' ');
                }
            }
        } else {
            cur.push(' ');
        }
        cur.push_str(&s);
        if let Some(tag) = last {
            speaker = Some(tag);
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_sentences() {
        assert_eq!(
            sentences("Hello world. \"Is it?\" she asked! Pi is 3.14 today... yes"),
            vec![
                "Hello world.",
                "\"Is it?\"",
                "she asked!",
                "Pi is 3.14 today... yes"
            ]
        );
        assert_eq!(sentences("你好。再见！"), vec!["你好。", "再见！"]);
        assert_eq!(sentences("no end"), vec!["no end"]);
    }

    #[test]
    fn groups_and_carries_speaker() {
        let g = segments("<|speaker:3|> One. Two. Three.", 10);
        assert_eq!(
            g,
            vec![
                "<|speaker:3|> One.",
                "<|speaker:3|> Two.",
                "<|speaker:3|> Three."
            ]
        );
        let g = segments("<|speaker:1|> A. B. <|speaker:2|> C. D.", 1000);
        assert_eq!(g, vec!["<|speaker:1|> A. B.", "<|speaker:2|> C. D."]);
        let g = segments("A. B.", 1000);
        assert_eq!(g, vec!["A. B."]);
        // A tag in the middle of a sentence carries into the next group.
        let g = segments(
            "<|speaker:0|>Hello! How are you?<|speaker:1|>I'm fine. Thanks.",
            20,
        );
        assert_eq!(g.last().unwrap(), "<|speaker:1|> Thanks.");
    }
}
