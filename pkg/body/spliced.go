package body

import "bytes"

// Spliced is a body as the pieces it is made of, in order: runs of the
// client's bytes and the values edits put between them. The pieces are shared
// with the Object and the edits, and are never changed.
type Spliced [][]byte

// Len is the body's size in bytes.
func (s Spliced) Len() int {
	n := 0
	for _, p := range s {
		n += len(p)
	}
	return n
}

// Bytes returns the body in one piece: the piece itself when there is one,
// else a copy of them all.
func (s Spliced) Bytes() []byte {
	if len(s) == 1 {
		return s[0]
	}
	return bytes.Join(s, nil)
}

// Chunks cuts the body into chunks of at most max bytes, in order; an empty
// body is one empty chunk. A chunk inside one piece is that piece's bytes;
// only a chunk that spans pieces is copied.
func (s Spliced) Chunks(max int) [][]byte {
	left := s.Len() // bytes not yet in a chunk
	out := make([][]byte, 0, left/max+len(s))
	var cur []byte  // the chunk being filled
	copied := false // cur is our own buffer, not a piece's bytes
	for _, p := range s {
		for len(p) > 0 {
			n := min(len(p), max-len(cur))
			switch {
			case len(cur) == 0:
				cur = p[:n]
			case !copied:
				cur = append(make([]byte, 0, min(max, len(cur)+left)), cur...)
				copied = true
				fallthrough
			default:
				cur = append(cur, p[:n]...)
			}
			p, left = p[n:], left-n
			if len(cur) == max {
				out = append(out, cur)
				cur, copied = nil, false
			}
		}
	}
	if len(cur) > 0 || len(out) == 0 {
		out = append(out, cur)
	}
	return out
}
