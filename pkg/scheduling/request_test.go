package scheduling

import (
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

func TestRequestReadsItsAPIsPrompt(t *testing.T) {
	tests := []struct {
		name       string
		api        *api.API
		body       string
		wantTokens int // at 4 characters per token
		wantN      int
	}{
		{"characters, rounded up", api.Chat, `{"messages":[{"role":"user","content":"Hi"}]}`, 2, 1}, // "user\nHi\n"
		{"characters, not bytes", api.Completions, `{"prompt":"héllo wörld ünïcode"}`, 5, 1},
		{"token ids count exactly", api.Generate, `{"token_ids":[1,2,3,4,5,6,7,8,9],"sampling_params":{"n":4}}`, 9, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obj, err := body.Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			r := NewRequest(tt.api.Prompt(obj))
			if got := r.PromptTokens(4); got != tt.wantTokens || r.N != tt.wantN {
				t.Errorf("PromptTokens(4), N = %d, %d; want %d, %d", got, r.N, tt.wantTokens, tt.wantN)
			}
		})
	}
}

func TestNilRequestHasNothingToGoBy(t *testing.T) {
	var r *Request
	if r.Prompt() != "" || r.PromptTokens(4) != 0 {
		t.Fatal("a nil request has a prompt")
	}
	if (&Request{N: 1, Prompts: 1}).Prompt() != "" {
		t.Fatal("a request without a prompt has one")
	}
}
