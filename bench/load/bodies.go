package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
)

// Model is the model name in every body; the prefill simulator serves it.
const Model = "meta-llama/Llama-3.1-8B-Instruct"

// vocabulary for the prompt text: mostly plain words, with the characters that
// make a JSON scanner work (quotes, backslashes, newlines, tabs, non-ASCII).
var vocabulary = append(strings.Fields(`the a of to and in is that for it as with was on be by this are or at from
	model token cache prefill decode request latency throughput memory engine router gateway envoy
	kubernetes cluster endpoint header body stream chunk buffer transfer block attention layer tensor
	"quoted" path\to\file café naïve 東京 データ 😀 résumé — … «» ½`), "line\nbreak", "\n\n", "tab\tseparated")

// escapedLen[i] is the length of vocabulary[i] inside a JSON string.
var escapedLen = func() []int {
	n := make([]int, len(vocabulary))
	for i, w := range vocabulary {
		n[i] = len(mustMarshal(w)) - 2
	}
	return n
}()

// chatBody returns a realistic OpenAI chat request of about size bytes: a
// system prompt, then alternating user/assistant turns of up to 8 KiB each,
// streamed with usage, as a chat client with a long history sends it.
func chatBody(size int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	req := struct {
		Model         string    `json:"model"`
		Messages      []message `json:"messages"`
		Stream        bool      `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
		MaxTokens   int     `json:"max_tokens"`
		Temperature float64 `json:"temperature"`
		TopP        float64 `json:"top_p"`
		User        string  `json:"user"`
	}{Model: Model, Stream: true, MaxTokens: 512, Temperature: 0.7, TopP: 0.95, User: "bench-user-42"}
	req.StreamOptions.IncludeUsage = true
	req.Messages = []message{{Role: "system", Content: "You are a helpful assistant. Answer concisely and cite the documents you are given."}}

	// The fixed part of the body, then turns until the text fills the rest;
	// escaping makes the encoded text a little longer than the raw words.
	fixed := mustMarshal(req)
	budget := size - len(fixed)
	var text strings.Builder
	roles := [2]string{"user", "assistant"}
	for turn := 0; ; turn++ {
		limit := min(budget-len(`,{"role":"assistant","content":""}`), 8<<10)
		if limit <= 0 {
			break
		}
		text.Reset()
		encoded := 0 // the text's length once JSON-escaped
		for {
			i := rng.IntN(len(vocabulary))
			if encoded+escapedLen[i]+1 > limit {
				break
			}
			if text.Len() > 0 {
				text.WriteByte(' ')
				encoded++
			}
			text.WriteString(vocabulary[i])
			encoded += escapedLen[i]
		}
		m := message{Role: roles[turn%2], Content: text.String()}
		req.Messages = append(req.Messages, m)
		budget -= len(mustMarshal(m)) + 1
	}
	return mustMarshal(req)
}

func mustMarshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// parseSize reads 4096, 4KiB or 2MiB.
func parseSize(s string) (int, error) {
	mult := 1
	num := s
	switch {
	case strings.HasSuffix(s, "KiB"):
		mult, num = 1<<10, strings.TrimSuffix(s, "KiB")
	case strings.HasSuffix(s, "MiB"):
		mult, num = 1<<20, strings.TrimSuffix(s, "MiB")
	}
	n, err := strconv.Atoi(num)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("body size %q: want a positive byte count, NKiB or NMiB", s)
	}
	return n * mult, nil
}

// sizeName prints a byte count as the flag would spell it.
func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return strconv.Itoa(n)
}
